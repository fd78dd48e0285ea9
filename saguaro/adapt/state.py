"""What the adaptive chooser holds: the profile's priors, each request's running state, the SSD side of its speed
model; and the two facts about a request every part of it reads (seeded; speculating last round)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from saguaro.adapt.estimate import AcceptanceEstimate
from saguaro.adapt.tree_choice import TreeModel
from saguaro.engine.sequence import Sequence


def is_seeded(seq: Sequence) -> bool:
    """A sampled request with a seed: its choices read no clock (see ``AdaptiveK``)."""
    return seq.generator is not None and seq.params.seed is not None


def was_speculating(seq: Sequence) -> bool:
    """Its last round asked for drafts (K > 0, or a probe)."""
    return bool(seq.spec.k_per_round) and seq.spec.k_per_round[-1] > 0


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
    advantage: float = 0.0  # its mean speedup over K = 0 in the rounds it speculated (``observe``)
    speculated: int = 0  # those rounds
    priced: tuple[float, float] | None = None  # the round in flight: its predicted cost (AR steps), K = 0's gain
    start: int = 0  # SSD: the K its coming AR step's build prepares, so that its next round asks it of the cache

    def probe_due(self) -> bool:
        """Its next round at K = 0 would be its probe (the interval is out)."""
        return self.at_zero >= self.interval

    def probe_next_but_one(self) -> bool:
        """Its round after the next would be its probe, if it stays at K = 0 (the interval is out a round on)."""
        return self.at_zero == self.interval - 1


@dataclass
class SSDModel:
    """The SSD side of the speed model: the miss strategy by batch size and the measured build."""
    jit_misses_at: Callable[[int], bool]  # batch size -> whether misses are drafted just in time (Thm 18)
    build_pass_prior_s: float  # one pass of a build (the glue or a step) before one is measured
    slowdown: float = 1.0  # the verification's beside a build (the profile's contention probe; 1 without one)
    trees: TreeModel | None = None  # the plan's cache trees, one chosen per round (None: the plan's own only)
    builds_time_drafts: bool = True  # a build's seconds are its draft passes' (on a GPU: the host's queueing)
    # the verification's beside one draft pass that streams the bus (the contention probe at one draft row): what a
    # probe's part is taken to add to a round until measured, and always for a seeded request (``probe_cost``)
    part_slowdown: float = 1.0
