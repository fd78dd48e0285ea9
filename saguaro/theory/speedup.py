"""Expected speedups of AR, SD and SSD (paper Sec. 3.2, Thm 2, Cors. 3, 4 and 17).

Units and symbols used throughout:

* One **verification** (a target forward pass over K+1 positions) takes 1 unit of time. Autoregressive (AR)
  decoding makes 1 token per unit, so every speedup below is "tokens per unit of time".
* ``a`` -- acceptance rate: the probability that a drafted token is accepted given that all earlier ones were
  (Thm 1: a = sum_x min(p_target(x), p_draft(x))). ``K`` -- speculative lookahead (tokens drafted per round).
* ``E`` -- expected tokens generated in one round (accepted drafts plus the bonus token).
  ``E_hit``: the round's speculation came from the primary speculator (a cache hit);
  ``E_miss``: it came from the backup speculator (a cache miss); ``E_SD``: ordinary SD.
* ``T_p``, ``T_b``, ``T_SD`` -- drafting time of the primary speculator, the backup speculator and the SD draft,
  relative to one verification.
* ``p_hit,p`` / ``p_hit,b`` -- probability of a cache hit given that the previous round was speculated by the
  primary / backup speculator; ``p_hit`` -- the unconditional (stationary) hit probability.
* ``b`` -- batch size. Sequences in a batch hit independently, each with probability ``p_hit``.

All functions accept NumPy-broadcastable inputs; a 0-d result is returned as a Python ``float``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "accepted_length_pmf",
    "expected_tokens",
    "sd_speedup",
    "unconditional_hit_rate",
    "hit_rate_after_rounds",
    "ssd_speedup",
    "ssd_speedup_batch",
    "ssd_speedup_batch_limit",
    "ssd_same_speculator_speedup",
    "ssd_over_sd_bounds",
]


def _out(x):
    x = np.asarray(x, dtype=float)
    return float(x) if x.ndim == 0 else x


def accepted_length_pmf(a: float, K: int) -> np.ndarray:
    """P(exactly k drafted tokens are accepted), k = 0..K: the capped geometric distribution.

    P(k) = a^k (1 - a) for k < K and P(K) = a^K (every draft accepted). Returns an array of length K+1 that
    sums to 1. ``a`` in [0, 1], ``K`` >= 0.
    """
    a = float(a)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {a}")
    if K < 0:
        raise ValueError(f"lookahead K must be >= 0, got {K}")
    k = np.arange(K + 1)
    pmf = a**k * (1.0 - a)
    pmf[K] = a**K
    return pmf


def expected_tokens(a, K):
    """Expected tokens per SD round: E = sum_{k=0}^{K} a^k = (1 - a^{K+1}) / (1 - a)  (E = K+1 at a = 1).

    The round yields (accepted drafts + 1 bonus token); accepted ~ capped geometric(a, K), so
    E = sum_k P(k) (k + 1) = sum_{k=0}^{K} a^k (Leviathan et al., 2023).
    """
    a = np.asarray(a, dtype=float)
    K = np.asarray(K, dtype=float)
    if np.any((a < 0) | (a > 1)):
        raise ValueError("acceptance rate must lie in [0, 1]")
    if np.any(K < 0):
        raise ValueError("lookahead K must be >= 0")
    one = np.isclose(a, 1.0)
    safe = np.where(one, 0.5, a)
    return _out(np.where(one, K + 1.0, (1.0 - safe ** (K + 1.0)) / (1.0 - safe)))


def sd_speedup(E_sd, T_sd):
    """Speedup of ordinary SD over AR: E_SD / (1 + T_SD).

    Each round drafts (time T_SD) and then verifies (time 1), and yields E_SD tokens on average.
    """
    return _out(np.asarray(E_sd, dtype=float) / (1.0 + np.asarray(T_sd, dtype=float)))


def unconditional_hit_rate(p_hit_p, p_hit_b):
    """Stationary cache-hit probability p_hit (Thm 2, extended, Appendix A, eq. for p_hit):

        p_hit = p_hit,b / (1 + p_hit,b - p_hit,p).

    Rounds form a two-state Markov chain on "which speculator produced this round's speculation": after a
    hit the primary's cached speculation is used (next hit w.p. p_hit,p), after a miss the backup's (next hit
    w.p. p_hit,b). p_hit is the chain's stationary probability of the primary state. Requires
    |p_hit,p - p_hit,b| < 1 (otherwise both states are absorbing and no unique stationary law exists).
    """
    pp = np.asarray(p_hit_p, dtype=float)
    pb = np.asarray(p_hit_b, dtype=float)
    if np.any((pp < 0) | (pp > 1) | (pb < 0) | (pb > 1)):
        raise ValueError("hit probabilities must lie in [0, 1]")
    if np.any(np.abs(pp - pb) >= 1.0):
        raise ValueError("need |p_hit,p - p_hit,b| < 1 for a unique stationary hit rate")
    return _out(np.clip(pb / (1.0 + pb - pp), 0.0, 1.0))  # clip float round-off at the ends


def hit_rate_after_rounds(p_hit_p, p_hit_b, T, p_hit_0=None):
    """Hit probability at round T from the recurrence in the proof of Thm 2 (Part 2).

    p_hit(T) = p_hit(T-1) p_hit,p + (1 - p_hit(T-1)) p_hit,b, which unrolls to
    p_hit(T) = p_hit(0) rho^T + p_hit,b (1 - rho^T) / (1 - rho), with rho = p_hit,p - p_hit,b.
    ``p_hit_0`` defaults to p_hit,p (round 0 is speculated by the primary). Tends to
    ``unconditional_hit_rate`` as T -> infinity.
    """
    pp = np.asarray(p_hit_p, dtype=float)
    pb = np.asarray(p_hit_b, dtype=float)
    p0 = pp if p_hit_0 is None else np.asarray(p_hit_0, dtype=float)
    rho = pp - pb
    if np.any(np.abs(rho) >= 1.0):
        raise ValueError("need |p_hit,p - p_hit,b| < 1")
    rT = rho ** np.asarray(T, dtype=float)
    return _out(p0 * rT + pb * (1.0 - rT) / (1.0 - rho))


def ssd_speedup(p_hit, E_hit, E_miss, T_p, T_b):
    """Thm 2: expected speedup of SSD over AR at batch size 1,

        speedup = [p_hit E_hit + (1 - p_hit) E_miss] / [p_hit max(1, T_p) + (1 - p_hit)(1 + T_b)].

    On a hit the next speculation was prepared during verification, so a round lasts max(1, T_p); on a miss the
    backup drafts after verification ends, so the round lasts 1 + T_b.
    """
    return ssd_speedup_batch(p_hit, E_hit, E_miss, T_p, T_b, 1)


def ssd_speedup_batch(p_hit, E_hit, E_miss, T_p, T_b, batch_size, T_w=0.0):
    """Cor. 17: expected per-sequence speedup of SSD over AR at batch size b,

        speedup = [p_hit E_hit + (1 - p_hit) E_miss] / [p_hit^b max(1, T_p) + (1 - p_hit^b)(1 + T_b) + T_w].

    The whole batch waits for the backup whenever any of its b (independent) sequences misses, so the round is
    fast only with probability p_hit^b. ``batch_size = np.inf`` gives the b -> infinity limit (needs p_hit < 1).
    ``T_w`` (0 in the paper) is what every round waits beyond that for the speculator's answer, as measured.
    """
    p = np.asarray(p_hit, dtype=float)
    b = np.asarray(batch_size, dtype=float)
    if np.any((p < 0) | (p > 1)):
        raise ValueError("p_hit must lie in [0, 1]")
    if np.any(b < 1):
        raise ValueError("batch size must be >= 1")
    tokens = p * np.asarray(E_hit, dtype=float) + (1.0 - p) * np.asarray(E_miss, dtype=float)
    all_hit = p**b
    latency = all_hit * np.maximum(1.0, np.asarray(T_p, dtype=float)) + (1.0 - all_hit) * (
        1.0 + np.asarray(T_b, dtype=float)
    ) + np.asarray(T_w, dtype=float)
    return _out(tokens / latency)


def ssd_speedup_batch_limit(p_hit, E_hit, E_miss, T_b):
    """Cor. 17, b -> infinity (p_hit < 1): speedup -> [p_hit E_hit + (1 - p_hit) E_miss] / (1 + T_b)."""
    p = np.asarray(p_hit, dtype=float)
    tokens = p * np.asarray(E_hit, dtype=float) + (1.0 - p) * np.asarray(E_miss, dtype=float)
    return _out(tokens / (1.0 + np.asarray(T_b, dtype=float)))


def ssd_same_speculator_speedup(p_hit, E_sd, T_sd):
    """Cor. 3: SSD whose primary and backup are both SD's draft (E_hit = E_miss = E_SD, T_p = T_b = T_SD):

        speedup = E_SD / [p_hit max(1, T_SD) + (1 - p_hit)(1 + T_SD)]  >=  E_SD / (1 + T_SD) = SD speedup,

    strictly greater when p_hit > 0 and T_SD > 0, because max(1, T_SD) < 1 + T_SD.
    """
    return ssd_speedup(p_hit, E_sd, E_sd, T_sd, T_sd)


def ssd_over_sd_bounds(p_hit, E_hit, E_sd, T_sd):
    """Cor. 4 (speedup sandwich): bounds on speedup_SSD / speedup_SD when T_p < 1 and T_b = 0.

        (1 + T_SD) (E_hit / E_SD) p_hit  <=  speedup_SSD / speedup_SD  <=  (1 + T_SD) (E_hit / E_SD).

    The lower bound uses E_miss >= 1 >= 0 (a round always yields the bonus token), the upper bound
    E_miss <= E_hit. Returns ``(lower, upper)``.
    """
    upper = (1.0 + np.asarray(T_sd, dtype=float)) * np.asarray(E_hit, dtype=float) / np.asarray(E_sd, dtype=float)
    return _out(upper * np.asarray(p_hit, dtype=float)), _out(upper)
