"""Predicted speedup over AR of one request's next round at K drafts (Thm 2 / Cor. 17 with measured costs).

Both models compare tokens per second against AR at the same batch size b, with every sequence of the batch
assumed to run the same K (each request is judged as if the batch were like it):

* SD: a round drafts K steps over b rows, then verifies b (K + 1) rows. With T_SD = K c_d(b) / c_v(b (K + 1)),
  ``sd_speedup(E, T_SD)`` is tokens per verification, and c_v(b) / c_v(b (K + 1)) turns a verification into
  AR steps.
* SSD: a hit round lasts max(verification slowed by the build beside it, build) -- the slowdown is what the
  calibration's contention probe measured for the memory bus the two share (``timeline.slowdowns``) -- a miss
  round the same verification plus the miss strategy's drafting (K just-in-time steps; nothing for a point-mass
  backup). ``ssd_speedup_batch`` weighs them with the request's hit rate (Cor. 17), then the same conversion
  to AR steps, whose verification runs alone.

K = 0 is AR: speedup 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.adapt.costs import LiveCosts
from saguaro.adapt.estimate import AcceptanceEstimate
from saguaro.theory.speedup import expected_tokens, sd_speedup, ssd_speedup_batch


def _to_ar(costs: LiveCosts, k: int, batch: int) -> tuple[float, float]:
    """(one verification's seconds, AR steps per verification) at K = k and batch size ``batch``."""
    verify = costs.verify(batch * (k + 1))
    return verify, costs.verify(batch) / verify


def sd_gain(estimate: AcceptanceEstimate, k: int, costs: LiveCosts, batch: int) -> float:
    if k == 0:
        return 1.0
    verify, ar_steps = _to_ar(costs, k, batch)
    t_sd = k * costs.draft_step(batch) / verify
    return float(sd_speedup(estimate.expected_tokens(k), t_sd)) * ar_steps


@dataclass
class SSDRound:
    """What an SSD round of one request looks like besides its acceptance."""
    p_hit: float  # the request's estimated cache-hit rate
    build_s: float  # the speculator's build beside a verification
    jit_misses: bool  # a miss is drafted just in time (K draft steps); else by a point-mass backup (free)
    backup_acceptance: float  # a point-mass backup's acceptance (E_miss when not just in time)
    slowdown: float = 1.0  # the verification's, beside a build (the bus contention)


def ssd_gain(estimate: AcceptanceEstimate, k: int, costs: LiveCosts, batch: int, round_: SSDRound) -> float:
    if k == 0:
        return 1.0
    alone, ar_steps = _to_ar(costs, k, batch)
    verify = alone * round_.slowdown
    ar_steps *= alone / verify
    e_hit = estimate.expected_tokens(k)
    if round_.jit_misses:
        e_miss, t_miss = e_hit, k * costs.draft_step(batch) / verify
    else:
        e_miss, t_miss = float(expected_tokens(round_.backup_acceptance, k)), 0.0
    speedup = ssd_speedup_batch(round_.p_hit, e_hit, e_miss, round_.build_s / verify, t_miss, batch)
    return float(speedup) * ar_steps
