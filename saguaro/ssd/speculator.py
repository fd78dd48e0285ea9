"""The speculator side of SSD (Algorithm 1), independent of transport and process.

Per round it does two things, in this order:

``respond(request)``: apply the verifier's outcomes to its copy of each sequence, then
answer every sequence with its next speculation: from the speculation cache on a hit,
otherwise from the fallback (just-in-time drafting by the primary draft for only the
sequences that missed, or a fast n-gram / random backup; with fallback "auto" the choice
follows the batch size, Thm 18).

``build(interrupted)``: while the target verifies what was just sent, glue that
speculation into the draft cache, predict the likely outcomes (top-F_k bonus guesses per
depth k, likeliest first) and decode the branches together, one tree-masked draft pass per
step. Each finished step makes its branches one token longer: every branch for the plan's
``branch_steps`` steps, then only the likeliest ``deep_branches`` (a tapered tree: a few
narrow steps buy the likeliest outcomes a longer speculation). If the next request arrives
early the build stops and branches keep the tokens they have.

The glue is usually one row. A speculation drafted by the primary comes with the draft's
ranked ids at each of its positions (from the tree step or the just-in-time step that drew
it), and its k/v is already computed: the just-in-time drafter wrote it into the sequence's
cache, and a hit's branch wrote it into the build's scratch, which ``respond`` copies over
before freeing the scratch. So only the last drafted token is fed, for the depth-K guesses.
A backup speculation (n-gram / random) has neither and is glued whole.

Fan-outs, the Saguaro sampling constant C and the fallback come from a ``SpecPlan`` (per
temperature, per batch size, and per source: the cache for a speculation drafted by the
primary uses F^p, one drafted by the backup uses F^b). Every token the primary draws for
index j of a speculation -- branch step j, or just-in-time step j -- is drawn from
sigma_{F_j, C} (Def. 14, ``saguaro_sampling``), and that distribution is what the verifier
receives, so the output stays exact.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.sampler import sample
from saguaro.spec.draft_model import DraftModelProposer, DraftState
from saguaro.spec.ngram_proposer import NgramProposer
from saguaro.spec.types import Ranked, RankTable, rank_positions, rank_table
from saguaro.ssd.cache import CachedSpeculation, SpeculationCache
from saguaro.ssd.outcomes import predict_outcomes
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import Admission, RoundRequest, RoundResponse, SpecRow
from saguaro.ssd.ranks import RankRecorder
from saguaro.ssd.saguaro_sampling import SaguaroSampling
from saguaro.ssd.tree import BranchLayout

log = logging.getLogger("saguaro.ssd")


@dataclass
class BuildStats:
    seconds: float = 0.0
    steps: int = 0  # branch steps completed (0..K)
    branches: int = 0


def _temperature(seq: Sequence) -> float:
    return 0.0 if seq.params.greedy else float(seq.params.temperature)


class AsyncSpeculator:
    """``fan_out`` is a ``SpecPlan`` or one F_0..F_K list (then ``fallback`` and ``saguaro_c`` apply to all)."""

    def __init__(self, runner: ModelRunner, k: int, fan_out: list[int] | SpecPlan, fallback: str = "jit",
                 saguaro_c: float = 1.0, recorder: RankRecorder | None = None):
        self.plan = fan_out if isinstance(fan_out, SpecPlan) else SpecPlan.fixed(list(fan_out), saguaro_c, fallback)
        if self.plan.k != k:
            raise ValueError(f"plan is for K={self.plan.k}, speculator for K={k}")
        self.runner = runner
        self.k = k
        self.batch = 1  # size of the batch in the last request
        self.fallback = self.plan.fallback_for(self.batch)
        self.fallback_switches: list[tuple[int, str]] = []  # (batch size, new fallback) for fallback "auto"
        self.saguaro = None  # Def. 14 sampling, only when some temperature uses C < 1
        if min(self.plan.c) < 1.0:
            self.saguaro = SaguaroSampling(lambda s: self.plan.fan_out(_temperature(s), "p", self.batch),
                                           lambda s: self.plan.c_for(_temperature(s)))
        self.width = self.plan.max_fan_out() + 1  # ranked ids kept per draft position (top-F_k plus the drafted)
        # the jit drafter also owns each sequence's draft KV state
        self.jit = DraftModelProposer(runner, self.saguaro.apply if self.saguaro else None, keep_ranked=self.width)
        self.ngram = NgramProposer()
        self.recorder = recorder
        self.seqs: dict[int, Sequence] = {}
        self.sent: dict[int, list[int]] = {}  # speculation under verification, per sequence
        self.source: dict[int, str] = {}  # who drafted it: "p" (primary draft) or "b" (fast backup)
        self.ranked: dict[int, list[Ranked]] = {}  # the draft's ranked ids at each position of it (primary only)
        self.scratch: dict[int, list[int]] = {}  # per sequence, the last build's branch blocks (until respond)
        self.prefilled: dict[int, list[int]] = {}  # tokens already in the draft cache of sequences not yet admitted
        self.cache = SpeculationCache()
        self.last_build = BuildStats()
        self._rng = random.Random(0)

    def fan_out_for(self, seq: Sequence) -> list[int]:
        """F_0..F_K for the cache of ``seq``'s speculation under verification."""
        return self.plan.fan_out(_temperature(seq), self.source.get(seq.seq_id, "p"), self.batch)

    def _set_batch(self, batch: int) -> None:
        self.batch = max(1, batch)
        fallback = self.plan.fallback_for(self.batch)
        if fallback != self.fallback:
            log.info("batch size %d: cache-miss fallback %s -> %s (b* = %.2f)", self.batch, self.fallback, fallback,
                     self.plan.b_star)
            self.fallback_switches.append((self.batch, fallback))
            self.fallback = fallback

    # -- prefill -----------------------------------------------------------------
    def prefill(self, req: RoundRequest) -> None:
        """Fill the draft cache with these sequences' tokens while the target prefills its own; their
        admission in the next round keeps it (so the first speculation drafts without a draft prefill).
        The last token is left out: drafting starts by feeding it (a resumed sequence gains no token in
        its prefill, so its admission brings nothing newer)."""
        items = []
        for adm in req.admissions:
            self._forget(adm.seq_id)
            cached = list(adm.tokens[:-1])
            state = self.jit.states[adm.seq_id] = DraftState()
            self.runner.blocks.reserve(state.block_table, len(cached))
            if cached:
                items.append(ForwardItem(cached, 0, state.block_table, "none"))
            state.num_cached = len(cached)
            self.prefilled[adm.seq_id] = cached
        if items:
            self.runner.forward(items)

    # -- respond -----------------------------------------------------------------
    def respond(self, req: RoundRequest) -> RoundResponse:
        start = time.perf_counter()
        for seq_id in req.releases:
            self._forget(seq_id)
        for adm in req.admissions:
            self._admit(adm)
        self._set_batch(len(req.order))
        hits: dict[int, CachedSpeculation] = {}
        for out in req.outcomes:
            seq, sent = self.seqs[out.seq_id], self.sent.get(out.seq_id, [])
            if self.recorder is not None:
                self.recorder.observe(out.seq_id, self.source.get(out.seq_id, "p"), len(sent), out.num_accepted,
                                      out.bonus, _temperature(seq))
            accepted = sent[:out.num_accepted] + [out.bonus]
            state = self.jit.states.get(seq.seq_id)
            if state is not None:  # the draft cache stays valid up to the accepted drafts
                state.num_cached = min(state.num_cached, len(seq) + out.num_accepted)
                self.runner.blocks.truncate(state.block_table, state.num_cached)
            seq.output_ids += accepted
            cached = self.cache.get(out.seq_id, out.num_accepted, out.bonus)
            if cached is not None:
                hits[out.seq_id] = cached
                self._adopt_kv(seq, state, cached)
            if self.recorder is not None:
                record = self.recorder.records[-1]
                record.hit, record.seq_id, record.length = cached is not None, out.seq_id, len(seq)
        self.cache.clear()
        self._free_scratch()
        order = [self.seqs[i] for i in req.order]
        misses = [s for s in order if s.seq_id not in hits]
        fallback_rows = self._fallback(misses)
        rows = []
        for seq in order:
            if seq.seq_id in hits:
                c = hits[seq.seq_id]
                row = SpecRow(True, c.tokens, c.probs)
                self.ranked[seq.seq_id] = c.ranked()
            else:
                row = fallback_rows[seq.seq_id]
            self.sent[seq.seq_id] = row.tokens
            self.source[seq.seq_id] = "b" if row.point_mass else "p"
            rows.append(row)
        return RoundResponse(rows, self.last_build.seconds, time.perf_counter() - start, self.last_build.steps)

    def _admit(self, adm: Admission) -> None:
        """Start tracking a sequence; keep the draft cache ``prefill`` filled for it if that holds a strict
        prefix of its tokens (else start over)."""
        prefilled = self.prefilled.get(adm.seq_id)
        keep = prefilled is not None and len(prefilled) < len(adm.tokens) and adm.tokens[:len(prefilled)] == prefilled
        state = self.jit.states.pop(adm.seq_id, None) if keep else None
        self._forget(adm.seq_id)  # frees a prefill that does not match
        seq = Sequence(adm.tokens, adm.params)
        seq.seq_id = adm.seq_id
        if seq.generator is not None:
            seq.generator.manual_seed(adm.seed)
        self.seqs[adm.seq_id] = seq
        if state is not None:
            self.jit.states[adm.seq_id] = state

    def _adopt_kv(self, seq: Sequence, state: DraftState | None, cached: CachedSpeculation) -> None:
        """Copy a hit branch's k/v (its bonus token and every drafted token but the last) from the build's
        scratch into the sequence's draft cache, right after the verified prefix, where the glue would
        otherwise recompute it."""
        if state is None or not cached.kv_slots or state.num_cached != len(seq) - 1:
            return
        end = state.num_cached + len(cached.kv_slots)
        self.runner.blocks.reserve(state.block_table, end)
        self.runner.cache.copy_slots(cached.kv_slots, self.runner.slots(state.block_table, state.num_cached, end))
        state.num_cached = end

    def _free_scratch(self, seq_id: int | None = None) -> None:
        for i in ([seq_id] if seq_id is not None else list(self.scratch)):
            table = self.scratch.pop(i, None)
            if table:
                self.runner.blocks.free(table)

    def _fallback(self, seqs: list[Sequence]) -> dict[int, SpecRow]:
        for s in seqs:
            self.ranked.pop(s.seq_id, None)
        if not seqs:
            return {}
        if self.fallback == "jit":
            proposal = self.jit.propose(seqs, [self.k] * len(seqs))
            for s, ranked in zip(seqs, proposal.ranked):
                self.ranked[s.seq_id] = ranked
            return {s.seq_id: SpecRow(False, toks, None if s.params.greedy else proposal.probs[b, :len(toks)].clone())
                    for b, (s, toks) in enumerate(zip(seqs, proposal.tokens))}
        if self.fallback == "ngram":
            proposal = self.ngram.propose(seqs, [self.k] * len(seqs))
            tokens = proposal.tokens
        else:
            vocab = self.runner.config.vocab_size
            tokens = [[self._rng.randrange(vocab) for _ in range(self.k)] for _ in seqs]
        return {s.seq_id: SpecRow(False, toks, None, point_mass=True) for s, toks in zip(seqs, tokens)}

    def _forget(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        self.prefilled.pop(seq_id, None)
        self.jit.drop(seq_id)  # its draft cache, admitted or only prefilled
        if seq is not None:
            self.ngram.release(seq)
        self.sent.pop(seq_id, None)
        self.source.pop(seq_id, None)
        self.ranked.pop(seq_id, None)
        self._free_scratch(seq_id)
        if self.recorder is not None:
            self.recorder.forget(seq_id)

    # -- build -------------------------------------------------------------------
    def build(self, interrupted: Callable[[], bool] = lambda: False) -> BuildStats:
        """Prepare the speculation cache for the outcomes of what was just sent."""
        start = time.perf_counter()
        stats = BuildStats()
        self._free_scratch()
        seqs = [self.seqs[i] for i, spec in self.sent.items() if spec and i in self.seqs]
        if seqs and (self.recorder is not None or not interrupted()):  # calibration needs every glue
            layouts = self._glue(seqs)
            scratch: list[list[int]] = [[] for _ in seqs]
            try:
                stats = self._decode_branches(seqs, layouts, scratch, interrupted)
            except BaseException:
                for table in scratch:
                    self.runner.blocks.free(table)
                raise
            # kept until the next respond: a hit adopts its branch's k/v from here
            self.scratch = {seq.seq_id: table for seq, table in zip(seqs, scratch) if table}
        stats.seconds = time.perf_counter() - start
        self.last_build = stats
        return stats

    def _glue(self, seqs: list[Sequence]) -> list[BranchLayout]:
        """Extend each draft cache with the speculation under verification; pick the branches.

        Depth j's guesses come from the draft's distribution after the verified prefix and d_1..d_j,
        i.e. from feeding position ``base + j`` (``base``: the last verified token). Positions whose
        k/v is cached and whose ranked ids came with the speculation are not fed again."""
        items, known = [], []
        for seq in seqs:
            state = self.jit.states.setdefault(seq.seq_id, DraftState())
            spec, base = self.sent[seq.seq_id], len(seq) - 1
            ranked = self.ranked.get(seq.seq_id) if self.recorder is None else None  # calibration ranks every depth
            start = min(state.num_cached, base)  # else re-feed the last verified token for its logits
            if ranked is not None and state.num_cached >= base:
                start = min(state.num_cached, base + len(ranked), base + len(spec))
            known.append(max(start - base, 0))
            self.runner.blocks.truncate(state.block_table, start)
            tokens = (seq.tokens + spec)[start:]
            self.runner.blocks.reserve(state.block_table, start + len(tokens))
            items.append(ForwardItem(tokens, start, state.block_table, "all"))
            state.num_cached = start + len(tokens)
        logits = self.runner.forward(items)
        depth_logits = [rows[-(len(self.sent[seq.seq_id]) + 1 - j0):] for seq, rows, j0 in zip(seqs, logits, known)]
        fresh = iter(rank_positions(torch.cat(depth_logits), self.width))  # depths j0..n of each, in one call
        layouts = []
        for seq, rows, j0 in zip(seqs, depth_logits, known):
            spec = self.sent[seq.seq_id]
            if self.recorder is not None:
                self.recorder.remember(seq.seq_id, rows, spec)
            ranked = (self.ranked.get(seq.seq_id) or [])[:j0] + [next(fresh) for _ in range(len(rows))]
            outcomes = predict_outcomes(ranked, spec, self.fan_out_for(seq))
            if self.recorder is not None and not self.recorder.build_branches:
                outcomes = []
            state = self.jit.states[seq.seq_id]
            layouts.append(BranchLayout(self.runner.slots(state.block_table, 0, state.num_cached), len(seq),
                                        [k for k, _ in outcomes], [t for _, t in outcomes],
                                        self.plan.branch_widths(len(outcomes), _temperature(seq)),
                                        block_table=list(state.block_table)))
        return layouts

    def _decode_branches(self, seqs, layouts, scratch, interrupted) -> BuildStats:
        """Decode the branches of every sequence together, one tree-masked pass per step; step j decodes
        each sequence's ``width(j)`` likeliest branches."""
        live = [i for i, lay in enumerate(layouts) if lay.num_branches]
        if not live:
            return BuildStats()
        for i in live:
            size = layouts[i].scratch_size(self.k)
            self.runner.blocks.reserve(scratch[i], size)
            layouts[i].scratch_slots = self.runner.slots(scratch[i], 0, size)
        # per live sequence and branch: the drafted tokens, and the rows (over all steps' passes) whose
        # distributions and ranked ids the tokens were drawn from
        tokens = {i: [[] for _ in range(layouts[i].num_branches)] for i in live}
        rows_of = {i: [[] for _ in range(layouts[i].num_branches)] for i in live}
        all_probs: list[torch.Tensor] = []
        tables: list[RankTable] = []
        # greedy drafts need no distributions (greedy verification compares tokens): take the argmax
        greedy_only = all(seqs[i].params.greedy for i in live) and self.saguaro is None
        done = steps = 0  # rows in the passes so far, passes so far
        for step in range(self.k):
            if step > 0 and interrupted():
                break
            rows = [(i, q) for i in live for q in range(layouts[i].width(step))]
            row_seqs = [seqs[i] for i, _ in rows]
            inputs = [tokens[i][q][-1] if step else layouts[i].roots[q] for i, q in rows]
            items, first = [], 0
            for i in live:
                width = layouts[i].width(step)
                items.append(layouts[i].step_item(step, inputs[first:first + width]))
                first += width
            logits = self.runner.forward_flat(items)[0]
            tables.append(rank_table(logits, self.width))
            if greedy_only:
                drawn = logits.argmax(dim=-1).tolist()
            else:
                step_probs = processed_probs(logits, row_seqs)
                if self.saguaro is not None:
                    step_probs = self.saguaro.apply(step_probs, step, row_seqs)  # Def. 14 for index ``step``
                greedy = torch.tensor([s.params.greedy for s in row_seqs])
                drawn = sample(step_probs, [s.generator for s in row_seqs], greedy).tolist()
                all_probs.append(step_probs)
            for r, (i, q) in enumerate(rows):
                tokens[i][q].append(drawn[r])
                rows_of[i][q].append(done + r)
            done += len(rows)
            steps += 1
        probs = self._branch_probs(seqs, rows_of, all_probs)
        table = RankTable.cat(tables) if tables else None
        for i in live:
            seq, lay = seqs[i], layouts[i]
            for q in range(lay.num_branches):
                kv_slots = [lay.scratch_slots[lay.offset(j) + q] for j in range(len(tokens[i][q]))]
                self.cache.put(seq.seq_id, lay.fork_depths[q], lay.roots[q],  # kv: the root, then tokens[:-1]
                               CachedSpeculation(tokens[i][q], probs.get((i, q)), table, rows_of[i][q], kv_slots))
        return BuildStats(steps=steps, branches=sum(layouts[i].num_branches for i in live))

    @staticmethod
    def _branch_probs(seqs, rows_of, all_probs) -> dict[tuple[int, int], torch.Tensor]:
        """[len(tokens), V] distributions of every sampled (non-greedy) branch: one gather per branch length."""
        by_length: dict[int, list[tuple[int, int]]] = {}
        for i, branches in rows_of.items():
            if not seqs[i].params.greedy:
                for q, rows in enumerate(branches):
                    by_length.setdefault(len(rows), []).append((i, q))
        if not by_length:
            return {}
        flat = torch.cat(all_probs)
        out = {}
        for members in by_length.values():
            gathered = flat[torch.tensor([rows_of[i][q] for i, q in members])]  # [branches, length, V]
            out.update(zip(members, gathered))
        return out

    def close(self) -> None:
        for seq_id in list(self.seqs):
            self._forget(seq_id)
        self._free_scratch()
