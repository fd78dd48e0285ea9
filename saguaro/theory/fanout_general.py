"""Thm 13: optimal fan-out for arbitrary (empirical) per-depth hit curves.

Input: K+1 hit curves, ``hit_curves[k][f]`` = p_hit^k(f) = probability that the bonus token lands among the
f cached guesses at depth k, given exactly k drafts were accepted (``hit_curves[K]`` is p_hit^{K,all}, all K
accepted and the bonus drawn from the target). Curves are estimated on calibration data by comparing draft and
target distributions. With P(k) the capped geometric law of accepted length (a^k (1-a) for k < K, a^K at K),
we maximize

    H(F) = sum_k P(k) p_hit^k(F_k)   subject to   sum_k F_k <= B,  0 <= F_k <= len(curve_k) - 1.

Thm 13 states the continuous optimum: the budget is used up and the weighted marginal gains agree,
d/dF p_hit^k(F_k) = a^{-k} d/dF p_hit^0(F_0) for k < K, and d/dF p_hit^{K,all}(F_K) = (1-a) a^{-K} d/dF
p_hit^0(F_0). For integer F we solve the discrete problem directly:

* ``greedy_fanout`` hands out budget units one by one to the depth with the largest weighted marginal gain
  P(k) [p_hit^k(F_k + 1) - p_hit^k(F_k)]. It is exactly optimal when every curve is concave (non-increasing
  increments): the problem is then a separable concave resource allocation, for which greedy is optimal
  (Gross 1956; Ibaraki & Katoh 1988). At the optimum the weighted increments are balanced -- the discrete form
  of Thm 13's condition.
* ``dp_fanout`` is an exact dynamic program for any curves (O((K+1) B^2)), e.g. the exact power law, which is
  not concave at the origin because 1 - 1^{-r} = 0 = p_hit(0).
* ``optimal_fanout`` picks greedy for concave curves and the DP otherwise.

For non-decreasing curves all three spend min(B, sum of maxima) units (an extra unit never lowers H).
"""

from __future__ import annotations

import heapq

import numpy as np

from .speedup import accepted_length_pmf

__all__ = ["depth_weights", "is_concave", "greedy_fanout", "dp_fanout", "optimal_fanout"]


def depth_weights(K: int, a: float | None = None, weights=None) -> np.ndarray:
    """P(k), k = 0..K: the capped geometric pmf for acceptance ``a``, or explicit ``weights`` as given."""
    if (a is None) == (weights is None):
        raise ValueError("give exactly one of a or weights")
    if weights is not None:
        w = np.asarray(weights, dtype=float)
        if w.shape != (K + 1,) or np.any(w < 0):
            raise ValueError("weights must be K+1 non-negative numbers")
        return w
    return accepted_length_pmf(a, K)


def _curves(hit_curves) -> list[np.ndarray]:
    curves = [np.asarray(c, dtype=float) for c in hit_curves]
    if not curves:
        raise ValueError("need at least one hit curve")
    for c in curves:
        if c.ndim != 1 or c.size == 0:
            raise ValueError("each hit curve must be a non-empty 1-D array indexed by fan-out")
    return curves


def is_concave(curve, tol: float = 1e-12) -> bool:
    """True when the increments curve[f+1] - curve[f] are non-increasing in f."""
    d = np.diff(np.asarray(curve, dtype=float))
    return bool(np.all(np.diff(d) <= tol))


def greedy_fanout(hit_curves, budget: int, a: float | None = None, weights=None) -> np.ndarray:
    """Greedy marginal allocation (optimal for concave curves). Returns integer F_0..F_K.

    ``a`` gives the capped-geometric depth weights; ``weights`` overrides them. Ties go to the lowest depth.
    """
    curves = _curves(hit_curves)
    K = len(curves) - 1
    w = depth_weights(K, a, weights)
    F = np.zeros(K + 1, dtype=np.int64)
    heap = [(-w[k] * (c[1] - c[0]), k) for k, c in enumerate(curves) if c.size > 1]
    heapq.heapify(heap)
    for _ in range(int(budget)):
        if not heap:
            break
        _, k = heapq.heappop(heap)
        F[k] += 1
        c = curves[k]
        if F[k] + 1 < c.size:
            heapq.heappush(heap, (-w[k] * (c[F[k] + 1] - c[F[k]]), k))
    return F


def dp_fanout(hit_curves, budget: int, a: float | None = None, weights=None) -> np.ndarray:
    """Exact optimum for arbitrary curves by dynamic programming over depths. Returns integer F_0..F_K.

    best[k][u] = max over F_0..F_k with sum exactly u of sum_{j<=k} P(j) p_hit^j(F_j); the answer is the best
    u <= budget, preferring the largest u among ties (so the budget is spent).
    """
    curves = _curves(hit_curves)
    K = len(curves) - 1
    w = depth_weights(K, a, weights)
    B = int(min(budget, sum(c.size - 1 for c in curves)))
    neg = -np.inf
    best = np.full(B + 1, neg)
    best[0] = 0.0
    choice = []
    for k, c in enumerate(curves):
        vals = w[k] * c[: min(c.size, B + 1)]
        nf = vals.size
        # cand[u, f] = best[u - f] + vals[f]
        u = np.arange(B + 1)[:, None]
        f = np.arange(nf)[None, :]
        prev = np.where(u - f >= 0, best[np.clip(u - f, 0, B)], neg)
        cand = prev + vals[None, :]
        arg = np.argmax(cand, axis=1)
        best = cand[np.arange(B + 1), arg]
        choice.append(arg)
    finite = np.isfinite(best)
    top = best[finite].max()
    u = int(np.nonzero(finite & (best >= top - 1e-12))[0].max())
    F = np.zeros(K + 1, dtype=np.int64)
    for k in range(K, -1, -1):
        F[k] = choice[k][u]
        u -= F[k]
    return F


def optimal_fanout(hit_curves, budget: int, a: float | None = None, weights=None) -> np.ndarray:
    """Thm 13 for integer fan-outs: greedy when every curve is concave, the exact DP otherwise."""
    curves = _curves(hit_curves)
    if all(is_concave(c) for c in curves):
        return greedy_fanout(curves, budget, a, weights)
    return dp_fanout(curves, budget, a, weights)
