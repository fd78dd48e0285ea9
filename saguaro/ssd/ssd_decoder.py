"""The verifier side of SSD: verify the waiting speculation, send the outcome, receive the next.

Per round, for the running batch:
  1. sequences that hold a speculation from the last response are verified in one target
     pass (the SD verifier, unchanged: it only ever sees tokens and the q they came from);
  2. one request goes to the speculator: each verified sequence's outcome (k, t*), new
     sequences' tokens, finished sequences' ids;
  3. one response comes back: the next speculation for every sequence (a hit, or drafted after a miss).
     A round whose every K is 0 is posted instead (``CMD_QUIET``): its rows would all be empty, so none is
     awaited. The speculator builds for the round after it only where the schedule expects that round to ask
     for drafts (``KSchedule.ahead``: a probe after K = 0 rounds).
If the speculator dies or stops answering, the decoder logs it and finishes every request
with lossless n-gram SD in this process; nothing in flight is lost.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from saguaro.engine.k_schedule import FixedK, KSchedule
from saguaro.engine.decoder import Decoder
from saguaro.device import stack_padded, to_device
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sd.ngram_proposer import NgramProposer
from saguaro.sd.sd import SDDecoder, draft_budget, verify_round
from saguaro.sd.types import Proposal
from saguaro.ssd.channel import ChannelClosed
from saguaro.ssd.link import SpeculatorLink
from saguaro.ssd.plan import MissStrategyTracker, SpecPlan
from saguaro.ssd_settings import MissStrategy
from saguaro.ssd.protocol import CMD_PREFILL, CMD_QUIET, CMD_ROUND, Admission, Outcome, RoundRequest, \
    RoundResponse, SpecRow
from saguaro.ssd.stream_priority import no_lane
from saguaro.ssd.target_features import TargetFeatures

log = logging.getLogger("saguaro.ssd")


@dataclass
class RoundTrace:
    start: float  # perf_counter at round start
    verify_s: float  # target verification
    wait_s: float  # from sending the outcome to holding the next speculation
    build_s: float  # speculator's cache build for this round (overlapping verification)
    build_steps: int
    # per verified sequence that speculated (its K > 0): was its speculation a cache hit
    hits: list[bool] = field(default_factory=list)
    miss_strategy: str = ""  # the miss strategy for this round's batch size (plan.MissStrategyTracker)
    emitted: list[int] = field(default_factory=list)  # per verified sequence: tokens the verification emitted


class SSDDecoder(Decoder):
    reports_spec = True
    reports_cache = True

    def __init__(self, target: ModelRunner, link: SpeculatorLink, plan: SpecPlan, max_model_len: int,
                 features: TargetFeatures | None = None, schedule: KSchedule | None = None):
        self.target = target
        self.features = features  # the target's features for an EAGLE-3 speculator (None: a draft model's)
        self.link: SpeculatorLink | None = link
        # a thread link on a GPU: the target's rounds on its high-priority stream (``stream_priority.py``)
        self.lane = getattr(link, "target_lane", None) or no_lane()
        self.plan = plan  # what the speculator was told (fan-outs, C, miss strategy)
        self.k = plan.k
        self.lookahead = self.k + 1
        self.max_model_len = max_model_len
        self.pending: dict[int, SpecRow] = {}
        self.prev_hit: dict[int, bool] = {}
        self.released: list[int] = []
        self.trace: list[RoundTrace] = []
        self.local_sd: SDDecoder | None = None  # n-gram SD in the target once the speculator is gone
        self.failure: str | None = None
        self.miss_strategies = MissStrategyTracker(plan)  # the speculator's, followed here for trace and log
        # each sequence's K for its next speculation (0: an AR step, and no build for it in the speculator)
        self.schedule = schedule if schedule is not None else FixedK(self.k)
        self.building = False  # the last request started a build: the verification after it ran beside one
        self.catching_up = False  # the last request named draft caches to catch up (beside the next verification)

    def decode(self, seqs: list[Sequence]) -> list[list[int]]:
        if self.link is None:
            return self.local_sd.decode(seqs)
        with self.lane():
            return self._round(seqs)

    def _round(self, seqs: list[Sequence]) -> list[list[int]]:
        """Verify what is pending, then send the outcomes and take the next speculations."""
        t0 = time.perf_counter()
        beside_parts = self.building or self.catching_up  # what the speculator does beside this verification
        out: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        ready = [s for s in seqs if s.seq_id in self.pending]
        outcomes, hits, verified_ks = [], [], []  # verified_ks: the K each was asked at
        if ready:
            proposal = self._proposal(ready)
            result = verify_round(self.target, ready, proposal)
            drafts = proposal.num_drafts()
            for b, (seq, k, bonus, tokens) in enumerate(zip(ready, result.num_accepted, result.bonus_tokens,
                                                             result.output_tokens)):
                outcomes.append(Outcome(seq.seq_id, k, bonus, self.features.verified(b, k) if self.features else None))
                out[seq.seq_id] = tokens
                hit = self.pending.pop(seq.seq_id).hit
                verified_ks.append(seq.spec.k_per_round[-1])  # before ``choose`` appends the next round's
                asked = verified_ks[-1] > 0  # a round asked at K = 0 (an AR step) neither hit nor missed
                if asked:  # (a miss answered with an empty row, strategy "skip", did miss)
                    hits.append(self._record_hit(seq, hit))
                self.schedule.observe(seq, drafts[b], k, hit if asked else None)
        t1 = time.perf_counter()
        if ready:
            drafted = sum(drafts)  # none: the speculator had nothing to build meanwhile
            self.schedule.observe_verify(len(ready) + drafted, t1 - t0, beside_build=self.building)
        verified = {s.seq_id for s in ready}
        admissions = [Admission(s.seq_id, s.tokens, s.params, _seed(s)) for s in seqs if s.seq_id not in verified]
        # the next speculation's K, from the rounds verified so far (this one included): never from its own drafts
        ks = self.schedule.choose(seqs)
        # every K is 0: every row of the answer would be empty, so the round is posted and not waited for
        quiet = not any(ks)
        ahead = self.schedule.ahead(seqs, ks)  # what the build beside the coming verification prepares for
        self.building = any(ahead)
        request = RoundRequest(outcomes, admissions, self.released, [s.seq_id for s in seqs], ks=ks,
                               prepare=None if ahead == ks else ahead, tree=self.schedule.tree,
                               catch_up=self.schedule.catch_up(seqs, ks), command=CMD_QUIET if quiet else CMD_ROUND)
        self.released = []
        self.catching_up = bool(request.catch_up)
        try:
            if quiet:
                self.link.post(request)
                response = _quiet_answer(seqs)
            else:
                response = self.link.exchange(request)
        except ChannelClosed as e:
            self._fail(str(e))
            return [out[s.seq_id] for s in seqs]
        for seq, row in zip(seqs, response.rows):
            self.pending[seq.seq_id] = row
        t2 = time.perf_counter()
        if not quiet:
            # the build beside this verification went as deep as the most K it verified (``Speculator._depth``)
            self.schedule.observe_answer(len(seqs), t2 - t1, max(verified_ks, default=0) or None)
        if response.build_steps:
            self.schedule.observe_build(response.build_s, response.build_steps)
        self.schedule.observe_round(verified_ks, t2 - t0, beside_parts)
        self.trace.append(RoundTrace(t0, t1 - t0, t2 - t1, response.build_s,
                                     response.build_steps, hits, self.miss_strategies.at(len(seqs)),
                                     [len(out[s.seq_id]) for s in ready]))
        return [out[s.seq_id] for s in seqs]

    def prefilling(self, seqs: list[Sequence], ends: list[int]) -> None:
        """Let the speculator prefill its draft while the target prefills, chunk by chunk (no response; the
        sequences are admitted for real, with their first token and seed, in the next round)."""
        if self.link is None or not seqs:
            return
        admissions = [Admission(s.seq_id, s.tokens if end == s.prefill_end else s.tokens[:end], s.params, 0)
                      for s, end in zip(seqs, ends)]
        request = RoundRequest(admissions=admissions, command=CMD_PREFILL)
        if self.features is None:
            self._send_prefill(request)
        else:  # an EAGLE-3 head prefills from the chunk's target features: sent once the target's pass has them
            self.features.after_next_pass(lambda: self._send_prefill(self.features.attach(request)))

    def _send_prefill(self, request: RoundRequest) -> None:
        if self.link is None:
            return
        try:
            self.link.post(request)
        except ChannelClosed as e:
            self._fail(str(e))

    @property
    def miss_strategy_switches(self) -> list[tuple[int, MissStrategy]]:
        """(batch size, new strategy) each time miss strategy "auto" switched."""
        return self.miss_strategies.switches

    def _proposal(self, seqs: list[Sequence]) -> Proposal:
        rows = [self.pending[s.seq_id] for s in seqs]
        for s, r in zip(seqs, rows):
            # a sampled row without its q could only be verified as a point mass: exact, but it would hide a
            # speculation whose distributions went astray, so it is an error here
            if not s.params.greedy and r.size and r.probs is None and not r.point_mass:
                raise RuntimeError(f"sequence {s.seq_id}: sampled speculation arrived without its distributions")
        budgets = [draft_budget(s, r.size, self.max_model_len) for s, r in zip(seqs, rows)]
        vocab = self.target.config.vocab_size
        probs = None
        if any(r.probs is not None for r in rows):
            # on the target's device: a colocated speculator's rows arrive there already, and a CPU speculator's
            # are copied in without the host waiting on the GPU
            probs = stack_padded([None if r.probs is None else r.probs[:n] for r, n in zip(rows, budgets)],
                                 max(max(budgets), 1), vocab, self.target.device)
        point_mass = torch.tensor([r.point_mass or r.probs is None for r in rows])
        if all(r.tokens is not None for r in rows):
            return Proposal([r.tokens[:n] for r, n in zip(rows, budgets)], probs, point_mass)
        # a colocated speculator's tokens still on its device: verified there, read with the outcome
        return Proposal(None, probs, point_mass, device_tokens=_device_tokens(rows), counts=budgets)

    def _record_hit(self, seq: Sequence, hit: bool) -> bool:
        stats = seq.spec
        stats.cache_hits += hit
        prev = self.prev_hit.get(seq.seq_id)
        if prev is True:
            stats.rounds_after_hit += 1
            stats.hits_after_hit += hit
        elif prev is False:
            stats.rounds_after_miss += 1
            stats.hits_after_miss += hit
        self.prev_hit[seq.seq_id] = hit
        return hit

    def _fail(self, reason: str) -> None:
        log.warning("speculator worker failed (%s); finishing requests with n-gram SD in the target process", reason)
        self.failure = reason
        self.link.kill()
        self.link = None
        self.pending.clear()
        self.local_sd = SDDecoder(self.target, NgramProposer(), self.k, self.max_model_len)

    def release(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
        self.prev_hit.pop(seq.seq_id, None)
        self.schedule.release(seq.seq_id)
        if self.link is not None:
            self.released.append(seq.seq_id)
        elif self.local_sd is not None:
            self.local_sd.release(seq)

    def close(self) -> None:
        if self.link is not None:
            self.link.stop()
            self.link = None


def _device_tokens(rows: list[SpecRow]) -> torch.Tensor:
    """[B, width] long on the speculator's device: each row's tokens (the ones it holds there, or its host ones
    copied in), zero padded."""
    device = next(r.device_tokens.device for r in rows if r.tokens is None)
    tokens = [r.device_tokens if r.tokens is None else to_device(torch.tensor(r.tokens, dtype=torch.long), device)
              for r in rows]
    return pad_sequence(tokens, batch_first=True)


def _quiet_answer(seqs: list[Sequence]) -> RoundResponse:
    """What the speculator answers a round whose every K is 0, and does not send: an empty row per sequence (its
    hit flag is never read for a row asked at K = 0), and no build to report."""
    return RoundResponse([SpecRow(False, [], None) for _ in seqs])


def _seed(seq: Sequence) -> int:
    if seq.generator is None:
        return 0
    return int(torch.randint(0, 2**62, (1,), generator=seq.generator))
