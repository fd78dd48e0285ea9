"""Shape of the speculation cache under a power-law hit curve: Thm 12 (geometric fan-out), Def. of r.

Symbols:

* ``K`` -- lookahead; depths k = 0..K index verification outcomes (k tokens accepted, then a bonus token).
* ``F_k`` -- fan-out at depth k: how many bonus-token guesses (cache entries) are prepared for outcome k.
* ``B`` -- budget: sum_k F_k <= B (how many branches the draft can finish during one verification).
* ``a`` -- acceptance rate of the speculator whose speculation is being verified (a_p or a_b).
* ``r`` -- power-law exponent (Def. "r power-law cache hit rate"): the miss probability with fan-out F is
  1 - p_hit(F) = F^{-r}, for F >= 1. We take p_hit(0) = 0 (no guesses, no hit).

The quantity being maximized (Appendix A, proof of Thm 13) is the hit probability

    p_hit({F_k}) = sum_{k<K} a^k (1 - a) p_hit^k(F_k) + a^K p_hit^{K,all}(F_K),

where a^k (1 - a) and a^K are the capped geometric probabilities that exactly k (< K) / all K drafts are
accepted. With p_hit^k(F) = 1 - F^{-r} at every depth the Lagrange conditions give (Thm 12)

    F_k = F_0 a^{k/(1+r)}                          for k < K,
    F_K = F_0 a^{K/(1+r)} (1 - a)^{-1/(1+r)},
    F_0 = B / [ a^{K/(1+r)} (1 - a)^{-1/(1+r)} + (1 - a^{K/(1+r)}) / (1 - a^{1/(1+r)}) ].

The real-valued optimum treats F as continuous (the objective 1 - F^{-r} is concave for F > 0).
"""

from __future__ import annotations

import numpy as np

from .speedup import accepted_length_pmf

__all__ = [
    "power_law_hit",
    "fanout_objective",
    "geometric_fanout",
    "round_fanout",
    "integer_geometric_fanout",
    "fit_power_law",
]


def power_law_hit(F, r: float):
    """r power-law hit curve: p_hit(F) = 1 - F^{-r} for F > 0 (real F allowed), p_hit(0) = 0."""
    F = np.asarray(F, dtype=float)
    if np.any(F < 0):
        raise ValueError("fan-out must be non-negative")
    safe = np.where(F > 0, F, 1.0)
    out = np.where(F > 0, 1.0 - safe ** (-float(r)), 0.0)
    return float(out) if out.ndim == 0 else out


def fanout_objective(F, a: float, r: float | None = None, hit_curves=None) -> float:
    """Expected hit probability sum_k P(k accepted) p_hit^k(F_k) of a fan-out vector F (length K+1).

    P(k) = a^k (1 - a) for k < K and a^K for k = K. Use either the power law (``r``) at every depth, or
    ``hit_curves``: a sequence of K+1 arrays with ``hit_curves[k][f]`` = p_hit^k(f) for integer f
    (``hit_curves[K]`` is p_hit^{K,all}); then F must be integral.
    """
    F = np.asarray(F, dtype=float)
    K = F.shape[-1] - 1
    pmf = accepted_length_pmf(a, K)
    if (r is None) == (hit_curves is None):
        raise ValueError("give exactly one of r or hit_curves")
    if r is not None:
        return float(np.sum(pmf * power_law_hit(F, r)))
    if len(hit_curves) != K + 1:
        raise ValueError("need one hit curve per depth")
    idx = np.rint(F).astype(int)
    if np.any(np.abs(idx - F) > 1e-9):
        raise ValueError("empirical hit curves need integer fan-outs")
    return float(sum(pmf[k] * np.asarray(hit_curves[k], dtype=float)[idx[k]] for k in range(K + 1)))


def _geometric_weights(a: float, r: float, K: int) -> np.ndarray:
    """Unnormalized Thm 12 shape w_k (F_k = F_0 w_k): a^{k/(1+r)} for k < K, times (1-a)^{-1/(1+r)} at K."""
    if not 0.0 < a < 1.0:
        raise ValueError(f"geometric fan-out needs 0 < a < 1, got {a}")
    if r <= 0:
        raise ValueError(f"power-law exponent must be > 0, got {r}")
    e = 1.0 / (1.0 + r)
    w = a ** (np.arange(K + 1) * e)
    w[K] *= (1.0 - a) ** (-e)
    return w


def _waterfill(weights: np.ndarray, budget: float, caps: np.ndarray) -> np.ndarray:
    """x_k = min(cap_k, lam w_k) with sum_k x_k = budget (caps must allow it). Exact in <= len(w) passes.

    For the power-law problem with upper bounds F_k <= cap_k this is again the KKT solution: capped depths sit
    at their bound, the others keep the common ratio F_k / w_k.
    """
    w = np.asarray(weights, dtype=float)
    if budget > caps.sum() + 1e-9:
        raise ValueError(f"budget {budget} exceeds the sum of caps {caps.sum()}")
    x = np.zeros_like(w)
    free = w > 0
    remaining = float(budget)
    while True:
        if not free.any() or remaining <= 0:
            break
        lam = remaining / w[free].sum()
        over = free & (lam * w > caps)
        if not over.any():
            x[free] = lam * w[free]
            break
        x[over] = caps[over]
        remaining -= caps[over].sum()
        free &= ~over
    return x


def _caps(max_fanout, n: int) -> np.ndarray:
    if max_fanout is None:
        return np.full(n, np.inf)
    caps = np.broadcast_to(np.asarray(max_fanout, dtype=float), (n,)).copy()
    if np.any(caps < 0):
        raise ValueError("max_fanout must be non-negative")
    return caps


def geometric_fanout(a: float, r: float, K: int, budget: float, max_fanout=None) -> np.ndarray:
    """Thm 12: the real-valued optimal fan-outs F_0..F_K (sum = ``budget``) for acceptance ``a`` and exponent
    ``r``.

    Without caps this is F_k = F_0 w_k with the closed-form F_0 of Appendix A. ``max_fanout`` (scalar or
    per-depth, e.g. vocab size - 1 for k < K since the drafted token is excluded) adds F_k <= cap_k; the
    optimum then clamps saturated depths and rescales the rest (water-filling).
    """
    w = _geometric_weights(a, r, K)
    if max_fanout is None:
        e = 1.0 / (1.0 + r)
        f0 = budget / (a ** (K * e) * (1.0 - a) ** (-e) + (1.0 - a ** (K * e)) / (1.0 - a**e))
        return f0 * w
    return _waterfill(w, budget, _caps(max_fanout, K + 1))


def round_fanout(values, budget: int, max_fanout=None) -> np.ndarray:
    """Integer fan-outs from real ones by largest-remainder rounding.

    The input is first rescaled to sum to ``budget`` within ``max_fanout`` (water-filling; a no-op for the
    output of ``geometric_fanout`` with the same caps). Each entry is floored, then the leftover units go to the
    largest fractional parts (ties to the lower depth). The result is non-negative, <= floor(cap), and sums
    exactly to ``budget``.
    """
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or np.any(v < 0) or not np.all(np.isfinite(v)):
        raise ValueError("values must be a 1-D array of finite non-negative numbers")
    budget = int(budget)
    if budget < 0:
        raise ValueError("budget must be non-negative")
    caps = np.floor(_caps(max_fanout, v.size))
    if v.sum() == 0:
        v = np.ones_like(v)
    x = _waterfill(v, budget, caps)
    out = np.floor(x + 1e-9).astype(np.int64)
    out = np.minimum(out, caps).astype(np.int64)
    left = budget - int(out.sum())
    frac = x - out
    for k in np.argsort(-frac, kind="stable"):
        if left <= 0:
            break
        if out[k] + 1 <= caps[k]:
            out[k] += 1
            left -= 1
    if left != 0:  # only reachable through float round-off; give the rest to any depth with room
        for k in range(v.size):
            take = int(min(left, caps[k] - out[k]))
            out[k] += take
            left -= take
    return out


def integer_geometric_fanout(a: float, r: float, K: int, budget: int, max_fanout=None) -> np.ndarray:
    """``round_fanout(geometric_fanout(...))``: integer Thm 12 fan-outs summing exactly to ``budget``."""
    return round_fanout(geometric_fanout(a, r, K, budget, max_fanout), budget, max_fanout)


def fit_power_law(F_values, miss_rates) -> float:
    """Least-squares estimate of r in 1 - p_hit(F) = F^{-r} (Def. r power-law), on log-log axes.

    Minimizes sum_i (log m_i + r log F_i)^2 (the definition has no prefactor, so the line passes through
    (log 1, log 1)), giving r = -sum log F_i log m_i / sum (log F_i)^2. Points with F <= 0 or a miss rate
    outside (0, 1] are dropped (log undefined); at least one point with F > 1 must remain.
    """
    F = np.asarray(F_values, dtype=float).ravel()
    m = np.asarray(miss_rates, dtype=float).ravel()
    if F.shape != m.shape:
        raise ValueError("F_values and miss_rates must have the same length")
    keep = (F > 0) & (m > 0) & (m <= 1)
    lf, lm = np.log(F[keep]), np.log(m[keep])
    denom = float(np.sum(lf * lf))
    if denom == 0.0:
        raise ValueError("need at least one point with F > 1 and a miss rate in (0, 1]")
    return float(-np.sum(lf * lm) / denom)
