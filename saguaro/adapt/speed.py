"""Predicted speedup over AR of one request's next round at K drafts (Thm 2 / Cor. 17 with measured costs).

Both models compare tokens per second against AR at the same batch size b, with every sequence of the batch
assumed to run the same K (each request is judged as if the batch were like it):

* SD: a round drafts K steps over b rows, then verifies b (K + 1) rows. With T_SD = K c_d(b) / c_v(b (K + 1)),
  ``sd_speedup(E, T_SD)`` is tokens per verification, and c_v(b) / c_v(b (K + 1)) turns a verification into
  AR steps.
* SSD: a hit round lasts max(verification slowed by the build beside it, build at that K) -- the slowdown is what the
  calibration's contention probe measured for the memory bus the two share (``timeline.slowdowns``) -- a miss
  round the same verification plus the miss strategy's drafting (K just-in-time steps; nothing for a point-mass
  backup); each then waits for the speculator's answer as rounds at this batch size have (``AdaptiveK.answer``).
  ``ssd_speedup_batch`` weighs them with the request's hit rate (Cor. 17), then the same conversion to AR steps,
  whose verification runs alone.

K = 0 is AR: speedup 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from saguaro.adapt.costs import LiveCosts
from saguaro.theory.speedup import expected_tokens, sd_speedup, ssd_speedup_batch


@dataclass
class BatchCosts:
    """The pass costs of one round at batch size ``batch``, for K = 0..max_k: computed once per round and shared
    by every request in it (only the acceptance and the hit rate are the request's own)."""
    batch: int
    verify: np.ndarray  # [max_k + 1]: seconds of one verification of the batch at each K
    draft_step: float  # seconds of one draft step over the batch

    @classmethod
    def at(cls, costs: LiveCosts, batch: int, max_k: int) -> "BatchCosts":
        verify = np.array([costs.verify(batch * (k + 1)) for k in range(max_k + 1)])
        return cls(batch, verify, costs.draft_step(batch))


def sd_gains(tokens: np.ndarray, costs: BatchCosts) -> np.ndarray:
    """Predicted speedup over AR at K = 0..max_k: ``tokens[..., k]`` = E(k) of a request (a row per request)."""
    k = np.arange(tokens.shape[-1])
    gains = np.array(sd_speedup(tokens, k * costs.draft_step / costs.verify) * costs.verify[0] / costs.verify)
    gains[..., 0] = 1.0
    return gains


@dataclass
class SSDRound:
    """What an SSD round of one request looks like besides its acceptance."""
    # per request (a float, or a column [B, 1] for a batch of requests):
    p_hit: float | np.ndarray  # the estimated cache-hit rate
    build_s: float | np.ndarray  # the speculator's build beside a verification (or [max_k + 1]: at each K)
    jit_misses: bool  # a miss is drafted just in time (K draft steps); else by a point-mass backup (free)
    backup_acceptance: float | np.ndarray  # a point-mass backup's acceptance (E_miss when not just in time)
    slowdown: float | np.ndarray = 1.0  # the verification's beside a build (the bus contention; or [max_k + 1])
    # what a round waits for the speculator's answer after its verification, as measured (or [max_k + 1]: at each K)
    answer_s: float | np.ndarray = 0.0


def ssd_gains(tokens: np.ndarray, costs: BatchCosts, round_: SSDRound,
              miss_tokens: np.ndarray | None = None) -> np.ndarray:
    """Predicted speedup over AR at K = 0..max_k (Cor. 17 at the batch size): ``tokens[..., k]`` = E_hit(k);
    ``miss_tokens`` E(k) of a just-in-time miss's K drafts where a hit carries fewer (a tapered tree)."""
    k = np.arange(tokens.shape[-1])
    verify = costs.verify * round_.slowdown
    if round_.jit_misses:
        e_miss, t_miss = tokens if miss_tokens is None else miss_tokens, k * costs.draft_step / verify
    else:
        e_miss, t_miss = np.asarray(expected_tokens(round_.backup_acceptance, k)), np.zeros(len(k))
    speedup = ssd_speedup_batch(round_.p_hit, tokens, e_miss, round_.build_s / verify, t_miss, costs.batch,
                                round_.answer_s / verify)
    gains = np.array(speedup * costs.verify[0] / verify)
    gains[..., 0] = 1.0
    return gains
