"""The verifier side of SSD: verify the waiting speculation, send the outcome, receive the next.

Per round, for the running batch:
  1. sequences that hold a speculation from the last response are verified in one target
     pass (the SD verifier, unchanged: it only ever sees tokens and the q they came from);
  2. one request goes to the speculator: each verified sequence's outcome (k, t*), new
     sequences' tokens, finished sequences' ids;
  3. one response comes back: the next speculation for every sequence (hit or fallback).
If the speculator dies or stops answering, the decoder logs it and finishes every request
with lossless n-gram SD in this process; nothing in flight is lost.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from saguaro.config import Config
from saguaro.engine.decoder import Decoder
from saguaro.engine.device import to_device
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.loading import LoadedModel
from saguaro.spec.ngram_proposer import NgramProposer
from saguaro.spec.sd import SDDecoder, draft_budget, verify_round
from saguaro.spec.types import Proposal
from saguaro.ssd.channel import ChannelClosed
from saguaro.ssd.link import SpeculatorLink
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import CMD_PREFILL, Admission, Outcome, RoundRequest, SpecRow
from saguaro.ssd.placement import open_link
from saguaro.ssd.worker import WorkerOptions

log = logging.getLogger("saguaro.ssd")


@dataclass
class RoundTrace:
    start: float  # perf_counter at round start
    verify_s: float  # target verification
    wait_s: float  # from sending the outcome to holding the next speculation
    build_s: float  # speculator's cache build for this round (overlapping verification)
    build_steps: int
    hits: list[bool] = field(default_factory=list)  # per verified sequence: was its speculation a cache hit
    fallback: str = ""  # the speculator's cache-miss fallback for this round's batch size (plan.fallback_for)


class SSDDecoder(Decoder):
    reports_spec = True
    reports_cache = True

    def __init__(self, target: ModelRunner, link: SpeculatorLink, k: int, max_model_len: int):
        self.target = target
        self.link: SpeculatorLink | None = link
        self.k = k
        self.lookahead = k + 1
        self.max_model_len = max_model_len
        self.pending: dict[int, SpecRow] = {}
        self.prev_hit: dict[int, bool] = {}
        self.released: list[int] = []
        self.trace: list[RoundTrace] = []
        self.fallback: SDDecoder | None = None
        self.failure: str | None = None
        self.plan: SpecPlan | None = None  # what the speculator was told (fan-outs, C, fallback)
        self.fallback_switches: list[tuple[int, str]] = []  # (batch size, fallback) each time "auto" switches

    def decode(self, seqs: list[Sequence]) -> list[list[int]]:
        if self.link is None:
            return self.fallback.decode(seqs)
        t0 = time.perf_counter()
        out: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        ready = [s for s in seqs if s.seq_id in self.pending]
        outcomes, hits = [], []
        if ready:
            proposal = self._proposal(ready)
            result = verify_round(self.target, ready, proposal)
            for seq, k, bonus, tokens in zip(ready, result.num_accepted, result.bonus_tokens, result.output_tokens):
                outcomes.append(Outcome(seq.seq_id, k, bonus))
                out[seq.seq_id] = tokens
                hits.append(self._record_hit(seq, self.pending.pop(seq.seq_id).hit))
        t1 = time.perf_counter()
        admissions = [Admission(s.seq_id, s.tokens, s.params, _seed(s)) for s in seqs if s not in ready]
        request = RoundRequest(outcomes, admissions, self.released, [s.seq_id for s in seqs])
        self.released = []
        try:
            response = self.link.exchange(request)
        except ChannelClosed as e:
            self._fail(str(e))
            return [out[s.seq_id] for s in seqs]
        for seq, row in zip(seqs, response.rows):
            self.pending[seq.seq_id] = row
        self.trace.append(RoundTrace(t0, t1 - t0, time.perf_counter() - t1, response.build_s,
                                     response.build_steps, hits, self._fallback_mode(len(seqs))))
        return [out[s.seq_id] for s in seqs]

    def prefilling(self, seqs: list[Sequence]) -> None:
        """Let the speculator prefill its draft while the target prefills (no response; the sequences are
        admitted for real, with their first token and seed, in the next round)."""
        if self.link is None or not seqs:
            return
        request = RoundRequest(admissions=[Admission(s.seq_id, s.tokens, s.params, 0) for s in seqs],
                               command=CMD_PREFILL)
        try:
            self.link.prefill(request)
        except ChannelClosed as e:
            self._fail(str(e))

    def _fallback_mode(self, batch: int) -> str:
        """Mirror of the speculator's choice (same plan, same batch size), logged here where logging is set up."""
        if self.plan is None:
            return ""
        mode = self.plan.fallback_for(batch)
        last = self.fallback_switches[-1][1] if self.fallback_switches else self.plan.fallback_for(1)
        if mode != last:
            log.info("batch size %d: SSD cache-miss fallback %s -> %s (b* = %.2f, Thm 18)", batch, last, mode,
                     self.plan.b_star)
            self.fallback_switches.append((batch, mode))
        return mode

    def _proposal(self, seqs: list[Sequence]) -> Proposal:
        rows = [self.pending[s.seq_id] for s in seqs]
        for s, r in zip(seqs, rows):
            # a sampled row without its q could only be verified as a point mass: exact, but it would hide a
            # speculation whose distributions went astray, so it is an error here
            if not s.params.greedy and r.tokens and r.probs is None and not r.point_mass:
                raise RuntimeError(f"sequence {s.seq_id}: sampled speculation arrived without its distributions")
        budgets = [draft_budget(s, len(r.tokens), self.max_model_len) for s, r in zip(seqs, rows)]
        tokens = [r.tokens[:n] for r, n in zip(rows, budgets)]
        vocab = self.target.config.vocab_size
        probs = None
        if any(r.probs is not None for r in rows):
            # on the target's device: a colocated speculator's rows arrive there already, and a CPU speculator's
            # are copied in without the host waiting on the GPU
            probs = torch.zeros(len(rows), max(max(budgets), 1), vocab, device=self.target.device)
            for b, (r, n) in enumerate(zip(rows, budgets)):
                if r.probs is not None and n:
                    probs[b, :n] = to_device(r.probs[:n], self.target.device)
        point_mass = torch.tensor([r.point_mass or r.probs is None for r in rows])
        return Proposal(tokens, probs, point_mass)

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
        self.fallback = SDDecoder(self.target, NgramProposer(), self.k, self.max_model_len)

    def release(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
        self.prev_hit.pop(seq.seq_id, None)
        if self.link is not None:
            self.released.append(seq.seq_id)
        elif self.fallback is not None:
            self.fallback.release(seq)

    def close(self) -> None:
        if self.link is not None:
            self.link.stop()
            self.link = None


def _seed(seq: Sequence) -> int:
    if seq.generator is None:
        return 0
    return int(torch.randint(0, 2**62, (1,), generator=seq.generator))


def uniform_fan_out(k: int, per_depth: int = 1) -> list[int]:
    return [per_depth] * (k + 1)


def build_plan(cfg: Config, vocab: int) -> SpecPlan:
    """Fan-outs, Saguaro C and fallback for the speculator.

    Explicit settings (a ``fan_out`` list or None for uniform 1s, a numeric ``saguaro_c``, a named
    ``fallback``, a ``branch_steps`` count or None) give a fixed plan. Any "auto" loads the calibration
    profile for (target, draft, dtype) -- or the documented defaults, with a warning -- and lets
    ``saguaro.calibration.policy.make_plan`` choose (Thm 12 / Thm 13 fan-outs per temperature, batch size and
    source; C; Thm 18's b*; the tree's taper); explicit settings still override their part of it.
    """
    k = cfg.num_speculative_tokens
    fixed = cfg.fan_out if isinstance(cfg.fan_out, list) else uniform_fan_out(k)
    autos = [cfg.fan_out, cfg.fallback, cfg.saguaro_c, cfg.branch_steps]
    if "auto" not in autos:
        return SpecPlan.fixed(fixed, float(cfg.saguaro_c), cfg.fallback, branch_steps=cfg.branch_steps,
                              deep_branches=cfg.deep_branches)
    from saguaro.calibration.policy import describe, make_plan, resolve_profile
    profile = resolve_profile(cfg.target, cfg.draft, cfg.dtype, k, fast=cfg.fast, draft_format=cfg.draft_format.tag,
                              workload=cfg.calibration_workload)
    plan = make_plan(profile, k, cfg.saguaro_c, cfg.fallback, cfg.max_num_seqs, vocab, cfg.branch_steps == "auto",
                     cfg.deep_branches)
    if cfg.fan_out != "auto":
        plan.primary = [[list(fixed)] for _ in plan.temperatures]
        plan.backup = [[list(fixed)] for _ in plan.temperatures]
    if cfg.branch_steps != "auto":
        plan.branch_steps = [cfg.branch_steps] * len(plan.temperatures)
    log.info("SSD plan (%s): %s", "defaults" if profile.get("default") else "calibrated", describe(plan))
    return plan


def build_ssd_decoder(cfg: Config, target: ModelRunner, target_model: LoadedModel, draft: LoadedModel,
                      max_model_len: int) -> SSDDecoder:
    vocab = target.config.vocab_size
    if isinstance(cfg.fan_out, list) and max(cfg.fan_out) > vocab:
        raise ValueError(f"fan_out entries must not exceed the vocabulary size ({vocab})")
    plan = build_plan(cfg, vocab)
    device = cfg.draft_device or cfg.device
    c = 1.0 if cfg.saguaro_c == "auto" else float(cfg.saguaro_c)
    opts = WorkerOptions(cfg.num_speculative_tokens, plan.fan_out(0.0, "p"), plan.fallback_for(1),
                         cfg.draft_torch_dtype, device, cfg.draft_cores, cfg.threads, cfg.kv_cache_tokens,
                         cfg.block_size, cfg.worker_timeout_s, c, plan, cfg.fast, cfg.draft_format)
    link = open_link(cfg.speculator_transport, draft, opts)  # Config placed it (saguaro.ssd.placement)
    decoder = SSDDecoder(target, link, cfg.num_speculative_tokens, max_model_len)
    decoder.plan = plan
    return decoder
