"""The speculator side of SSD (Algorithm 1), independent of transport and process.

Per round it does two things, in this order:

``respond(request)``: apply the verifier's outcomes to its copy of each sequence, then
answer every sequence with its next speculation: from the speculation cache on a hit,
otherwise by the miss strategy (just-in-time drafting by the primary draft for only the
sequences that missed, or a point-mass n-gram / random backup; with strategy "auto" the choice
follows the batch size, Thm 18). The hits are gathered on the draft's device and read
together with the just-in-time drafts: one read.

``build(interrupted)``: while the target verifies what was just sent, glue that
speculation into the draft cache, predict the likely outcomes (top-F_k bonus guesses per
depth k, likeliest first) and decode the branches together, one tree-masked draft pass per
step. Each finished step makes its branches one token longer: every branch for the plan's
``branch_steps`` steps, then only the likeliest ``deep_branches`` (a tapered tree: a few
narrow steps buy the likeliest outcomes a longer speculation). If the next request arrives
early the build stops and branches keep the tokens they have. The build reads from the device
once, for the glue's ranking (it chooses the branches); the branches' tokens stay in the cache's
token table there. On the paged backend with graphs (a GPU) the whole build is one graph replay instead
(``graph_build.py``): its branches are chosen on the device and it reads nothing; the next ``respond``
reads its keys with the hits' tokens.

The glue is usually one row. A speculation drafted by the primary comes with the draft's
ranked ids at each of its positions (from the tree step or the just-in-time step that drew
it), and its k/v is already computed: the just-in-time drafter wrote it into the sequence's
cache, and a hit's branch wrote it into the build's scratch, which ``respond`` copies over
before freeing the scratch. So only the last drafted token is fed, for the depth-K guesses.
A backup speculation (n-gram / random) has neither and is glued whole.

An EAGLE-3 head (``eagle/runner.py``) drafts from the target's features, which the messages bring (a prefill
chunk's, a round's verified positions'), and from its own hidden states past them. So after an outcome its
cache keeps only the rows built on the target's features, a hit's branch k/v is not adopted, and the glue
re-feeds the accepted tokens with the features just received.

Fan-outs, the Saguaro sampling constant C and the miss strategy come from a ``SpecPlan`` (per
temperature, per batch size, and per drafter: the cache for a speculation drafted by the
primary uses F^p, one drafted by the backup uses F^b). Every token the primary draws for
index j of a speculation -- branch step j, or just-in-time step j -- is drawn from
sigma_{F_j, C} (Def. 14, ``saguaro_sampling``), and that distribution is what the verifier
receives, so the output stays exact.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from saguaro.backends.paged.backend import PagedBackend
from saguaro.device import read_together, to_device
from saguaro.engine.model_runner import DraftRunner, ForwardItem
from saguaro.engine.sequence import Sequence
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.ranked import RankTable, rank_positions, rank_table, ranked_rows
from saguaro.sampling.sampler import inverse_cdf, sample
from saguaro.sd.draft_model import DraftModelProposer
from saguaro.ssd import graph_staging
from saguaro.ssd.cache import BranchGroup, CachedBranch, SpeculationCache
from saguaro.ssd.counter_rng import branch_counter, counter_uniforms
from saguaro.ssd.graph_build import GraphBuild
from saguaro.ssd.miss_drafts import MissDrafts
from saguaro.ssd.outcomes import predict_outcomes
from saguaro.ssd.plan import MissStrategyTracker, SpecPlan
from saguaro.ssd.prefill_work import PrefillWork
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest, RoundResponse, SpecRow
from saguaro.ssd.saguaro_sampling import SaguaroSampling
from saguaro.ssd.seq_state import SeqState
from saguaro.ssd.spoken import Spoken, SpokenRow
from saguaro.ssd_settings import DraftedBy, MissStrategy
from saguaro.ssd.tree import BranchLayout


@dataclass
class BuildStats:
    # host seconds; on a GPU the time to queue the build (its last steps run on while the next respond's
    # read waits for them), on the CPU the build itself
    seconds: float = 0.0
    steps: int = 0  # branch steps completed (0..K)
    branches: int = 0


@dataclass
class DraftStep:
    """One build step's pass: a row per decoded branch, each sequence's in turn (its likeliest first)."""
    drawn: torch.Tensor  # [rows] the tokens drawn, on the draft's device
    ranks: RankTable  # the draft's likeliest ids at each row
    probs: torch.Tensor | None  # [rows, V] what they were drawn from; None when every row is greedy


def seq_temperature(seq: Sequence) -> float:
    return 0.0 if seq.params.greedy else float(seq.params.temperature)


class Speculator:
    """The SSD draft side: ``respond`` answers a round from the speculation cache, ``build`` fills it for the
    next one. Synchronous; a transport (``link.py``) runs it in a thread or a process beside the target
    (``host.py`` starts and serves it). K, the fan-outs, C and the miss strategy are ``plan``'s.

    On the paged backend with graphs (the GPU path, and its CPU stand-in in tests) a build that fits one
    ``BuildShape`` replays a graph of the whole build (``graph_build.py``); ``graph_build = False`` turns that
    off. There every draw of a build, the Python build's too, comes from ``counter_rng``."""

    graph_build = True

    def __init__(self, runner: DraftRunner, plan: SpecPlan):
        self.plan = plan
        self.runner = runner
        # an EAGLE-3 head (``eagle/runner.py``) reads the target's features: the messages bring them, and after an
        # outcome the head keeps only the rows built on them (the self-conditioned ones are recomputed)
        self.conditioned = runner.reads_features
        self.k = plan.k
        self.batch = 1  # size of the batch in the last request
        self.tree = 0  # the plan's tree the last request asked the build for (RoundRequest.tree)
        self.miss_strategies = MissStrategyTracker(self.plan)  # follows the batch size (strategy "auto", Thm 18)
        self.saguaro_sampling = None  # Def. 14 sampling, only when some temperature uses C < 1
        if min(self.plan.c) < 1.0:
            self.saguaro_sampling = SaguaroSampling(lambda s: self.plan.fan_out(seq_temperature(s), DraftedBy.PRIMARY,
                                                                     self.batch, self.tree),
                                           lambda s: self.plan.c_for(seq_temperature(s)))
        self.width = self.plan.max_fan_out() + 1  # ranked ids kept per draft position (top-F_k plus the drafted)
        self.states: dict[int, SeqState] = {}  # per sequence id, from its prefill or admission to its release
        # the just-in-time drafter works on each sequence's own draft cache (SeqState.draft)
        reweight = self.saguaro_sampling.apply if self.saguaro_sampling else None
        self.jit = DraftModelProposer(runner, reweight, keep_ranked=self.width,
                                      state_of=lambda seq: self.states[seq.seq_id].draft, graphs=not self.conditioned)
        self.cache = SpeculationCache()
        self.prefills = PrefillWork(runner)  # prefill tokens taken, fed in pieces while idle
        self.last_build = BuildStats()
        self._rng = random.Random(0)
        self.graph = self._graph_build()
        self.counter_rng = self.graph is not None  # the Python build draws what the graph build would
        # where the graph build can run, a round's answer stays on the device (``Spoken``) and the host reads once
        self.on_device = self.graph is not None and not self.conditioned and self.saguaro_sampling is None
        self.spoken: Spoken | None = None

    def _graph_build(self) -> GraphBuild | None:
        backend = getattr(self.runner, "backend", None)
        graphs = getattr(backend, "graphs", None)
        if (not self.graph_build or not isinstance(backend, PagedBackend) or graphs is None
                or type(self)._glued is not Speculator._glued):  # a recorder reads the Python build's glue
            return None
        return GraphBuild(backend.net, self.runner.cache, graphs.capture, self.runner.device)

    def capture_builds(self, max_seqs: int) -> None:
        """Capture the build graph of every shape a round of at most ``max_seqs`` sequences can take, and the
        just-in-time drafter's steps graph, now (start-up): no round then captures beside the target. Nothing where
        builds run in Python."""
        if self.graph is not None:
            self.graph.capture_all(graph_staging.startup_shapes(self, max_seqs))
        if self.on_device and self.jit.steps_graph is not None:  # and the just-in-time drafter's K steps
            self.jit.steps_graph.capture_all(max_seqs, self.k, min(self.width, self.runner.config.vocab_size))

    def fan_out_for(self, state: SeqState) -> list[int]:
        """F_0..F_K for the cache of a sequence's speculation under verification (in the round's tree)."""
        return self.plan.fan_out(seq_temperature(state.seq), state.drafted_by, self.batch, self.tree)

    @property
    def miss_strategy(self) -> MissStrategy:
        """The miss strategy for the current batch size: jit, ngram or random."""
        return self.miss_strategies.current

    @property
    def miss_strategy_switches(self) -> list[tuple[int, MissStrategy]]:
        return self.miss_strategies.switches

    def _set_batch(self, batch: int) -> None:
        self.batch = max(1, batch)
        self.miss_strategies.at(self.batch)

    # -- prefill -----------------------------------------------------------------
    def prefill(self, req: RoundRequest) -> None:
        """Take these sequences' tokens for the draft cache while the target prefills its own; their admission
        in the next round keeps it (so the first speculation drafts without a draft prefill). Only recorded
        here: ``prefill_piece`` feeds them in the speculator's idle time, and the admission whatever is left
        (``prefill_work.py``). The last token is left out: drafting starts by feeding it (a resumed sequence
        gains no token in its prefill, so its admission brings nothing newer). A chunked prefill sends growing
        prefixes: each adds only what the last one did not."""
        for adm in req.admissions:
            cached = list(adm.tokens[:-1])
            state = self.states.get(adm.seq_id)
            done = state.prefilled if state is not None else None
            if done is None or cached[:len(done)] != done:
                state = self._fresh(adm.seq_id, SeqState(prefilled=[]))
            state.take_features(adm.features_start, adm.features, self.runner.device)
            state.prefilled = cached
            self.prefills.add(adm.seq_id, state)

    def prefill_piece(self) -> bool:
        """Feed one piece of the pending prefill, sized by time (``prefill_work.py``); False if none was pending."""
        return self.prefills.piece(self.states)

    # -- respond -----------------------------------------------------------------
    def respond(self, req: RoundRequest) -> RoundResponse:
        """Apply the outcomes, then answer every sequence in ``req.order``: the hits from the cache, gathered on
        the draft's device, and the misses' drafts by the miss strategy. The host reads the device once: on the
        graph-build path for which branch hit (``_look_up``), else for the hits' and the misses' drafts."""
        start = time.perf_counter()
        for seq_id in req.releases:
            self._forget(seq_id)
        for adm in req.admissions:
            self._admit(adm)
        self._set_batch(len(req.order))
        self.tree = req.tree
        self._look_up(req.outcomes)
        hits: dict[int, CachedBranch] = {}
        adopted: tuple[list[int], list[int]] = ([], [])  # the hits' branch k/v: scratch slots -> cache slots
        for out in req.outcomes:
            state = self.states[out.seq_id]
            seq, draft = state.seq, state.draft
            accepted = state.sent[:out.num_accepted] + [out.bonus]
            # the draft cache stays valid up to the accepted drafts; a head's, up to the rows built on the target's
            # features (x_{n-1}'s, fed g_{n-2}): its rows past them read its own hidden states, now replaced
            valid = len(seq) if self.conditioned else len(seq) + out.num_accepted
            draft.num_cached = min(draft.num_cached, valid)
            self.runner.blocks.truncate(draft.block_table, draft.num_cached)
            state.take_features(len(seq) - 1, out.features, self.runner.device)
            seq.output_ids += accepted
            cached = self.cache.get(out.seq_id, out.num_accepted, out.bonus)
            if cached is not None:
                hits[out.seq_id] = cached
                if not self.conditioned:  # a head's branch k/v read its own features: the glue recomputes them
                    self._adopt_kv(state, cached, adopted)
            self._verified(state, out, cached is not None)
        if adopted[0]:
            self.runner.cache.copy_slots(*adopted)  # every hit's at once
        order = [self.states[i] for i in req.order]
        hit_states = [s for s in order if s.seq.seq_id in hits]
        limit = dict(zip(req.order, req.ks or [self.k] * len(order)))  # K per sequence (0: answer with nothing)
        prepare = dict(zip(req.order, req.prepare)) if req.prepare is not None else limit  # and for the build
        misses = [s for s in order if s.seq.seq_id not in hits]
        answer = self._answer_on_device if self.on_device else self._answer
        rows = answer(hit_states, [hits[s.seq.seq_id] for s in hit_states], misses, limit)
        for state in order:
            row = rows[state.seq.seq_id]
            state.asked = prepare[state.seq.seq_id]
            state.sent = row.tokens  # None while on the device (``state.spoken``)
            state.drafted_by = DraftedBy.BACKUP if row.point_mass else DraftedBy.PRIMARY
        self._catch_up(req.catch_up)
        return RoundResponse([rows[i] for i in req.order], self.last_build.seconds, time.perf_counter() - start,
                             self.last_build.steps)

    def _catch_up(self, seq_ids: list[int]) -> None:
        """Queue the verified tokens these sequences' draft caches lack (all but the last, which drafting starts
        by feeding) as idle-time work, like a prefill's (``prefill_work.py``): a sequence at K = 0 two rounds
        before its probe. What is left unfed when a build comes is glued then. A draft head conditioned on the
        target's features catches up in its glue only."""
        for seq_id in seq_ids:
            state = self.states.get(seq_id)
            if state is None or state.seq is None or self.conditioned:
                continue
            state.prefilled = state.seq.tokens[:-1]
            self.prefills.add(seq_id, state)

    def _look_up(self, outcomes: list[Outcome]) -> None:
        """The graph-build path's one read of a round: which branch of the build hit for each sequence (looked up
        on the device, ``SpeculationCache.match``), and the tokens of the speculations just verified, still on
        the device (``Spoken``). The outcomes are applied to each sequence with them. Nothing elsewhere."""
        match = self.cache.match([(o.seq_id, o.num_accepted, o.bonus) for o in outcomes])
        spoken = [s for s in self.states.values() if s.spoken is not None]
        pieces = ([match] if match is not None else []) + ([self.spoken.tokens] if spoken else [])
        values = read_together(pieces)
        if match is not None:
            self.cache.matched(values[0])
        if spoken:
            self._take_spoken(spoken, values[-1])

    def _take_spoken(self, states: list[SeqState], tokens: list[list[int]],
                     ranks: tuple[list, list] | None = None) -> None:
        """Give ``states`` their speculations (and ranked ids, if read) from ``Spoken``'s values; then none is
        left on the device. ``states``: every one whose speculation waits there."""
        for s in states:
            row = s.spoken
            s.sent = tokens[row.row][:row.tokens]
            s.ranked = None if ranks is None else ranked_rows(ranks[0][row.row][:row.ranked],
                                                              ranks[1][row.row][:row.ranked])
            s.spoken = None
        self.spoken = None

    def _answer(self, hit_states: list[SeqState], hit_list: list[CachedBranch], misses: list[SeqState],
                limit: dict[int, int]) -> dict[int, SpecRow]:
        """The rows, read: the hits gathered on the device and read together with the misses' drafts, once."""
        pieces, hit_probs = self.cache.gather(hit_list)
        self.cache.clear()
        self._free_scratch()
        drafts = self._draft_misses(misses, [limit[s.seq.seq_id] for s in misses])
        values = read_together(pieces + drafts.pieces)  # the round's one read from the draft's device
        hit_values, values = values[:len(pieces)], values[len(pieces):]
        rows = dict(drafts.answer(misses, values))
        if hit_list:
            tokens, ranked = hit_values[0], iter(ranked_rows(hit_values[1], hit_values[2]))
            for state, hit, row, probs in zip(hit_states, hit_list, tokens, hit_probs):
                state.ranked = [next(ranked) for _ in hit.rank_rows]
                n = min(hit.length, limit[state.seq.seq_id])
                rows[state.seq.seq_id] = SpecRow(True, row[:n], None if probs is None else probs[:n])
        return rows

    def _answer_on_device(self, hit_states: list[SeqState], hit_list: list[CachedBranch], misses: list[SeqState],
                          limit: dict[int, int]) -> dict[int, SpecRow]:
        """The rows, unread (the graph-build path): the hits' tokens and ranked ids gathered on the device and the
        misses' just-in-time drafts left there, together one ``Spoken``; the verifier reads the tokens with its
        outcome and the next build stages from it. A point-mass backup's rows are on the host already."""
        parts, rows, hit_probs = [], {}, []
        if hit_list:
            spoken, hit_probs = self.cache.gather_spoken(hit_list, self.k)
            parts.append(spoken)
        self.cache.clear()
        self._free_scratch()
        drafts = self._draft_misses(misses, [limit[s.seq.seq_id] for s in misses])
        if drafts.proposal is not None:
            parts.append(drafts.spoken(self.k))
        else:
            rows.update(drafts.answer(misses, []))
        if not parts:
            return rows
        self.spoken = Spoken.cat(parts)
        views = self.spoken.tokens.unbind(0)
        for r, (state, hit, probs) in enumerate(zip(hit_states, hit_list, hit_probs)):
            n = min(hit.length, limit[state.seq.seq_id])
            state.ranked, state.spoken = None, SpokenRow(r, n, hit.length)
            if probs is not None and n < hit.length:
                probs = probs[:n]
            rows[state.seq.seq_id] = SpecRow(True, None, probs, device_tokens=views[r], count=n)
        if drafts.proposal is not None:
            rows.update(drafts.answer_on_device(misses, views[len(hit_list):], len(hit_list)))
        return rows

    def _admit(self, adm: Admission) -> None:
        """Start tracking a sequence; keep the draft cache ``prefill`` filled for it if that holds a strict
        prefix of its tokens (else start over)."""
        state = self.states.get(adm.seq_id)
        done = state.prefilled if state is not None else None
        if done is None or len(done) >= len(adm.tokens) or adm.tokens[:len(done)] != done:
            state = self._fresh(adm.seq_id, SeqState())  # frees a prefill that does not match
        else:
            self.prefills.finish(state)  # what the idle time did not feed
        state.prefilled = None
        seq = state.seq = Sequence(adm.tokens, adm.params)
        seq.seq_id = adm.seq_id
        state.seed = adm.seed
        if seq.generator is not None:
            seq.generator.manual_seed(adm.seed)

    def _fresh(self, seq_id: int, state: SeqState) -> SeqState:
        """Start ``seq_id`` over as ``state``, keeping the target's features that arrived for it."""
        old = self.states.get(seq_id)
        state.draft.features = old.draft.features if old is not None else None
        self._forget(seq_id)
        self.states[seq_id] = state
        return state

    def _adopt_kv(self, state: SeqState, cached: CachedBranch, adopted: tuple[list[int], list[int]]) -> None:
        """Take a hit branch's k/v (its bonus token and every drafted token but the last) from the build's
        scratch into the sequence's draft cache, right after the verified prefix, where the glue would
        otherwise recompute it: its slots join ``adopted`` (source, destination), copied once for all hits."""
        draft = state.draft
        slots = cached.kv_slots
        if not slots or draft.num_cached != len(state.seq) - 1:
            return
        end = draft.num_cached + len(slots)
        self.runner.blocks.reserve(draft.block_table, end)
        adopted[0].extend(slots)
        adopted[1].extend(self.runner.slots(draft.block_table, draft.num_cached, end))
        draft.num_cached = end

    def _free_scratch(self) -> None:
        for state in self.states.values():
            self.runner.blocks.free(state.scratch)

    def _draft_misses(self, states: list[SeqState], ks: list[int]) -> MissDrafts:
        """Speculations of ``ks[i]`` tokens for the sequences whose outcome the cache missed (or that are new).
        The just-in-time drafter leaves its drafts and ranked ids on the device, for ``respond``'s one read."""
        if not states:
            return MissDrafts()
        for s in states:
            s.ranked = None
        seqs = [s.seq for s in states]
        if self.miss_strategy == MissStrategy.JIT:
            return MissDrafts(self.jit.propose(seqs, ks, read=False))
        if self.miss_strategy == MissStrategy.SKIP:  # an AR step; the build beside it prepares the next round
            return MissDrafts(point_mass=[[] for _ in states], empty=True)
        if self.miss_strategy == MissStrategy.NGRAM:
            tokens = []
            for s, k in zip(states, ks):
                s.ngram.follow(s.seq.tokens)
                tokens.append(s.ngram.propose(k) if k else [])
        else:
            vocab = self.runner.config.vocab_size
            tokens = [[self._rng.randrange(vocab) for _ in range(k)] for k in ks]
        return MissDrafts(point_mass=tokens)

    def _forget(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            state.free(self.runner.blocks)

    def _verified(self, state: SeqState, outcome: Outcome, hit: bool) -> None:
        """Called once the outcome of ``state``'s speculation is applied (``state.sent`` and ``state.drafted_by``
        are still the verified speculation's); calibration records it (``ranks.RecordingSpeculator``)."""

    # -- build -------------------------------------------------------------------
    def build(self, interrupted: Callable[[], bool] = lambda: False) -> BuildStats:
        """Prepare the speculation cache for the outcomes of what was just sent."""
        start = time.perf_counter()
        stats = BuildStats()
        self._free_scratch()
        # a sequence asked for drafts, or whose next round will ask (a probe after K = 0 rounds: built for the
        # outcome of the AR step now verifying, its fork at depth 0)
        states = [s for s in self.states.values() if s.seq is not None and (s.sent_count or s.asked)]
        if states and not interrupted():
            try:  # the scratch is kept until the next respond: a hit adopts its branch's k/v from there
                staged = graph_staging.stage(self, states, seq_temperature) if self.graph is not None else None
                if staged is not None:
                    stats = self._replay_build(states, staged)
                else:
                    self._read_spoken()  # the Python build glues on the host
                    stats = self._decode_branches(states, self._glue(states), interrupted)
            except BaseException:
                self._free_scratch()
                raise
        stats.seconds = time.perf_counter() - start
        self.last_build = stats
        return stats

    def _replay_build(self, states: list[SeqState], staged: graph_staging.StagedBuild) -> BuildStats:
        """The build as one graph replay: one staging copy, no read; its keys stay on the device."""
        out = self.graph.run(staged.shape, staged.rows, self.spoken, staged.spoken)
        self.cache.fill_pending([s.seq.seq_id for s in states], staged.groups, out.keys, out.tokens,
                                RankTable(out.rank_ids, out.rank_probs), out.probs)
        return BuildStats(steps=self.k, branches=len(states) * staged.shape.branches)

    def _read_spoken(self) -> None:
        """Read every speculation still on the device, with its ranked ids (a build that cannot stage them there)."""
        states = [s for s in self.states.values() if s.spoken is not None]
        if states:
            tokens, ids, probs = read_together([self.spoken.tokens, self.spoken.rank_ids, self.spoken.rank_probs])
            self._take_spoken(states, tokens, (ids, probs))

    def _glue(self, states: list[SeqState]) -> list[BranchLayout]:
        """Extend each draft cache with the speculation under verification; pick the branches.

        Depth j's guesses come from the draft's distribution after the verified prefix and d_1..d_j,
        i.e. from feeding position ``base + j`` (``base``: the last verified token). Positions whose
        k/v is cached and whose ranked ids came with the speculation are not fed again."""
        items, known = [], []
        for state in states:
            seq, draft, sent = state.seq, state.draft, state.sent
            base = len(seq) - 1
            start = min(draft.num_cached, base)  # else re-feed the last verified token for its logits
            if state.ranked is not None and draft.num_cached >= base:
                start = min(draft.num_cached, base + len(state.ranked), base + len(sent))
            known.append(max(start - base, 0))
            self.runner.blocks.truncate(draft.block_table, start)
            tokens = (seq.tokens + sent)[start:]
            self.runner.blocks.reserve(draft.block_table, start + len(tokens))
            items.append(ForwardItem(tokens, start, draft.block_table, "all", features=draft.features))
            draft.num_cached = start + len(tokens)
        logits = self.runner.forward(items)
        depth_logits = [rows[-(len(s.sent) + 1 - j0):] for s, rows, j0 in zip(states, logits, known)]
        fresh = iter(rank_positions(torch.cat(depth_logits), self.width))  # depths j0..n of each, in one call
        layouts = []
        for state, rows, j0 in zip(states, depth_logits, known):
            seq, draft = state.seq, state.draft
            self._glued(state, rows)
            ranked = (state.ranked or [])[:j0] + [next(fresh) for _ in range(len(rows))]
            outcomes = predict_outcomes(ranked, state.sent, self.fan_out_for(state))
            layouts.append(BranchLayout(self.runner.slots(draft.block_table, 0, draft.num_cached), len(seq),
                                        [k for k, _ in outcomes], [t for _, t in outcomes],
                                        self.plan.branch_widths(len(outcomes), seq_temperature(seq), self.tree),
                                        block_table=list(draft.block_table)))
        return layouts

    def _glued(self, state: SeqState, logits: torch.Tensor) -> None:
        """Called with the draft's logits at each depth of ``state``'s speculation (``logits[j]``: after the
        verified prefix and d_1..d_j; the depths the glue fed); calibration records them."""

    def _decode_branches(self, states: list[SeqState], layouts: list[BranchLayout],
                         interrupted: Callable[[], bool]) -> BuildStats:
        """Decode the branches of every sequence together, one tree-masked pass per step (``_draft_step``);
        step j decodes each sequence's ``width(j)`` likeliest branches (``layouts[i]``: those of ``states[i]``),
        their k/v in each sequence's scratch blocks. The drawn tokens go into the cache's token table."""
        live = [i for i, lay in enumerate(layouts) if lay.num_branches]
        if not live:
            return BuildStats()
        seqs = [s.seq for s in states]
        depth = self._depth([states[i] for i in live])
        for i in live:
            size = layouts[i].scratch_size(depth)
            self.runner.blocks.reserve(states[i].scratch, size)
            layouts[i].scratch_slots = self.runner.slots(states[i].scratch, 0, size)
        # greedy drafts need no distributions (greedy verification compares tokens): take the argmax
        greedy_only = all(seqs[i].params.greedy for i in live) and self.saguaro_sampling is None
        widths = [[layouts[i].width(j) for i in live] for j in range(depth)]  # [step][live sequence]
        starts = [list(accumulate(w, initial=0))[:-1] for w in widths]  # each one's first row in the step's pass
        steps: list[DraftStep] = []
        seeds = [states[i].seed for i in live]
        for step in range(depth):
            if step > 0 and interrupted():
                break
            steps.append(self._draft_step(step, live, layouts, seqs, widths, starts,
                                          steps[-1] if steps else None, greedy_only, seeds))
        done = list(accumulate((len(d.drawn) for d in steps), initial=0))  # pass rows before each step
        groups, first_row = [], 0
        for n, i in enumerate(live):
            lay = layouts[i]
            groups.append(BranchGroup(first_row, lay.num_branches, [done[j] + starts[j][n] for j in range(len(steps))],
                                      [widths[j][n] for j in range(len(steps))], not seqs[i].params.greedy,
                                      lay.scratch_slots, lay.step_offsets(len(steps))))
            first_row += lay.num_branches
        probs = [d.probs for d in steps if d.probs is not None]
        self.cache.fill(groups, [d.drawn for d in steps], RankTable.cat([d.ranks for d in steps]) if steps else None,
                        torch.cat(probs) if probs else None, self.k, self.runner.device)
        for i, group in zip(live, groups):
            lay = layouts[i]
            self.cache.put(seqs[i].seq_id, list(zip(lay.fork_depths, lay.roots)), group)
        return BuildStats(steps=len(steps), branches=first_row)

    def _depth(self, states: list[SeqState]) -> int:
        """Build steps: the most K the verifier last asked of these sequences (the plan's K where it asks none).
        The K of the speculation a hit will answer is chosen only after this build, and K moves slowly, so the
        last one stands for it; a hit asked for more carries the steps made, as after a build cut short. Steps
        past it would only slow the verification beside them (the bus they share) for drafts nobody asks."""
        return max(self.k if s.asked is None else min(s.asked, self.k) for s in states)

    def _draft_step(self, step: int, live: list[int], layouts: list[BranchLayout], seqs: list[Sequence],
                    widths: list[list[int]], starts: list[list[int]], last: DraftStep | None,
                    greedy_only: bool, seeds: list[int]) -> DraftStep:
        """One build step: every decoded branch's input (its root at step 0, else what ``last`` drew for it:
        widths never grow, so ``last`` decoded every branch of this step) -> one tree-masked pass -> the
        tokens drawn, left on the draft's device to feed the next step and fill the token table there.
        ``widths[j][n]``: branches of ``live[n]`` decoded at step j; ``starts[j][n]``: the first one's pass row."""
        width = widths[step]
        row_seqs = [seqs[i] for i, w in zip(live, width) for _ in range(w)]
        if last is None:
            inputs = torch.tensor([r for i, w in zip(live, width) for r in layouts[i].roots[:w]], dtype=torch.long)
        else:  # branch q of live[n] was row starts[step - 1][n] + q of the last pass
            where = [f + q for f, w in zip(starts[step - 1], width) for q in range(w)]
            inputs = last.drawn[to_device(torch.tensor(where), last.drawn.device)]
        items, first = [], 0
        for i, w in zip(live, width):
            items.append(layouts[i].step_item(step, inputs[first:first + w]))
            first += w
        logits = self.runner.forward_flat(items)[0]
        ranks = rank_table(logits, self.width)
        if greedy_only:
            return DraftStep(logits.argmax(dim=-1), ranks, None)
        probs = processed_probs(logits, row_seqs)
        if self.saguaro_sampling is not None:
            probs = self.saguaro_sampling.apply(probs, step, row_seqs)  # Def. 14 for index ``step``
        greedy = torch.tensor([s.params.greedy for s in row_seqs])
        if not self.counter_rng:
            return DraftStep(sample(probs, [s.generator for s in row_seqs], greedy), ranks, probs)
        lays = [layouts[i] for i in live]  # the graph build's draws: counter uniforms of (seed, L, k, q, step)
        keys = torch.tensor([(seed, lay.verified_len, lay.fork_depths[q], q)
                             for seed, lay, w in zip(seeds, lays, width) for q in range(w)], dtype=torch.int64)
        u = counter_uniforms(keys[:, 0], branch_counter(keys[:, 1], keys[:, 2], keys[:, 3], step))
        drawn = torch.where(to_device(greedy, probs.device), probs.argmax(dim=-1), inverse_cdf(probs, u))
        return DraftStep(drawn, ranks, probs)

    def close(self) -> None:
        for seq_id in list(self.states):
            self._forget(seq_id)
