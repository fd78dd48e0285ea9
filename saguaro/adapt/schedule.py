"""The adaptive K chooser (``AdaptiveK``): each request's K for the coming round, chosen online from what was
verified before it (the seam it fills, ``KSchedule``, is ``saguaro.engine.k_schedule``'s)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from saguaro.adapt.costs import LiveCosts
from saguaro.adapt.estimate import AcceptanceEstimate
from saguaro.adapt_settings import AdaptSettings
from saguaro.adapt.speed import BatchCosts, SSDRound, sd_gains, ssd_gains
from saguaro.engine.k_schedule import KSchedule
from saguaro.engine.sequence import Sequence


def _column(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=float)[:, None]


@dataclass
class Priors:
    """What the calibration profile says before a request's first round, per calibrated temperature."""
    temperatures: list[float]
    acceptance: list[list[float]]  # the primary draft's a_j by position
    backup_acceptance: list[float]  # the point-mass backup's (SSD, n-gram misses)
    p_hit: list[float]  # SSD's cache-hit rate at batch 1 under the plan

    def index(self, seq: Sequence) -> int:
        t = 0.0 if seq.params.greedy else float(seq.params.temperature)
        return min(range(len(self.temperatures)), key=lambda i: abs(self.temperatures[i] - t))


@dataclass
class RequestState:
    prior_index: int  # the calibrated temperature its priors come from
    estimate: AcceptanceEstimate
    hit_rate: AcceptanceEstimate  # SSD: a one-position estimate of the cache-hit rate
    at_zero: int = 0  # rounds in a row at K = 0 since the last probe
    interval: int = 8  # rounds at K = 0 before the next probe
    probing: bool = False  # the last round was a probe


@dataclass
class SSDModel:
    """The SSD side of the speed model: the miss strategy by batch size and the measured build."""
    jit_misses_at: Callable[[int], bool]  # batch size -> whether misses are drafted just in time (Thm 18)
    build_prior_s: float  # the build's time before one is measured
    slowdown: float = 1.0  # the verification's beside a build (the profile's contention probe; 1 without one)


class AdaptiveK(KSchedule):
    """Per request: a running acceptance estimate by position (``AcceptanceEstimate``, prior from the profile),
    and each round the K in 0..max with the best predicted speedup (``speed.py``: Thm 2 with the live pass
    costs). Speculation must be predicted to beat AR by ``settings.min_gain``; a request at K = 0 probes with
    ``probe_k`` drafts every ``interval`` rounds (doubling while probes do not pay), so it returns to
    speculation when its text becomes predictable.

    A sampled request with a seed chooses from its own verified rounds only: the profile's costs at batch 1,
    its prior hit rate, never a clock or its neighbours. Its K, and so its draws, are then the same alone or
    in any batch, run after run, as at a fixed K; requests without a seed use everything measured."""

    def __init__(self, max_k: int, settings: AdaptSettings, costs: LiveCosts, priors: Priors,
                 ssd: SSDModel | None = None):
        super().__init__(settings.cap(max_k))
        self.settings = settings
        self.costs = costs
        self.profile = LiveCosts(dict(costs.target), dict(costs.draft))  # never timed: for seeded requests
        self.priors = priors
        self.ssd = ssd
        self.states: dict[int, RequestState] = {}

    def state(self, seq: Sequence) -> RequestState:
        state = self.states.get(seq.seq_id)
        if state is None:
            s, i = self.settings, self.priors.index(seq)
            prior = [s.prior] if s.prior is not None else self.priors.acceptance[i]
            state = self.states[seq.seq_id] = RequestState(
                i, AcceptanceEstimate(prior, s.prior_rounds, s.decay),
                AcceptanceEstimate([self.priors.p_hit[i]], s.prior_rounds, s.decay), interval=s.probe_interval)
        return state

    def _choose(self, seqs: list[Sequence]) -> list[int]:
        if self.max_k == 0 or not seqs:
            return [0] * len(seqs)
        seeded = [s.generator is not None and s.params.seed is not None for s in seqs]
        ks: dict[int, int] = {}
        for reproducible in (False, True):
            group = [s for s, flag in zip(seqs, seeded) if flag == reproducible]
            if group:
                costs = (BatchCosts.at(self.profile, 1, self.max_k) if reproducible
                         else BatchCosts.at(self.costs, len(seqs), self.max_k))
                for seq, row in zip(group, self.gains(group, costs, reproducible)):
                    ks[seq.seq_id] = self._one(seq, row)
        return [ks[s.seq_id] for s in seqs]

    def gains(self, seqs: list[Sequence], costs: BatchCosts, reproducible: bool = False) -> np.ndarray:
        """[B, max_k + 1]: each sequence's predicted speedup over AR at K = 0..max_k in a round of ``costs``
        (one array computation for the batch: the chooser runs every round). ``reproducible``: from the
        profile's hit rate and build time, not the measured ones."""
        states = [self.state(seq) for seq in seqs]
        tokens = np.array([state.estimate.expected_tokens(self.max_k) for state in states])
        if self.ssd is None:
            return sd_gains(tokens, costs)
        hit = [self.priors.p_hit[st.prior_index] if reproducible else st.hit_rate.rate(0) for st in states]
        build = self.ssd.build_prior_s if reproducible else self.costs.build_s or self.ssd.build_prior_s
        round_ = SSDRound(_column(hit), build, self.ssd.jit_misses_at(costs.batch),
                          _column([self.priors.backup_acceptance[state.prior_index] for state in states]),
                          self.ssd.slowdown)
        return ssd_gains(tokens, costs, round_)

    def _one(self, seq: Sequence, gains: np.ndarray) -> int:
        state, s = self.state(seq), self.settings
        best = 1 + int(np.argmax(gains[1:]))
        if gains[best] >= s.min_gain:
            state.at_zero, state.probing, state.interval = 0, False, s.probe_interval
            return best
        if state.probing:  # the probe did not pay: wait longer for the next one
            state.interval = min(2 * state.interval, s.max_probe_interval)
            state.probing = False
        state.at_zero += 1
        if state.at_zero > state.interval:
            state.at_zero, state.probing = 0, True
            return min(s.probe_k, self.max_k)
        return 0

    def observe(self, seq: Sequence, drafted: int, kept: int, hit: bool | None = None) -> None:
        state = self.state(seq)
        state.estimate.observe(drafted, kept)
        if hit is not None and drafted:
            state.hit_rate.observe(1, int(hit))
        seq.spec.acceptance_estimate = state.estimate.rates(self.max_k)

    def observe_verify(self, rows: int, seconds: float, beside_build: bool = False) -> None:
        # the tables hold the verification alone: one timed beside a build is divided by the bus slowdown
        slowdown = self.ssd.slowdown if self.ssd is not None and beside_build else 1.0
        self.costs.observe_verify(rows, seconds / slowdown)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        self.costs.observe_draft(rows, steps, seconds)

    def observe_build(self, seconds: float) -> None:
        self.costs.observe_build(seconds)

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)


__all__ = ["AdaptiveK", "Priors", "RequestState", "SSDModel"]
