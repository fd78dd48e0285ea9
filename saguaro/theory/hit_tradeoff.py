"""Saguaro sampling (Def. 14), its acceptance / cache-hit trade-off (Thm 1, Thm 15) and the Appendix A
construction, on explicit probability vectors over a vocabulary of size V.

Symbols: ``p_target`` (p_t) -- the target's next-token distribution; ``p_draft`` -- the draft's own
distribution softmax(z); ``q`` -- the distribution the draft token is actually *sampled* from (p_draft, or
sigma_{F,C}(z) under Saguaro sampling; verification must use q so the output stays exactly p_t-distributed);
``F`` -- fan-out (cache size at this depth); ``C`` in [0, 1] -- down-weighting constant.

One verification step of a drafted token x ~ q (Leviathan et al. 2023): accept with probability
min(1, p_t(x)/q(x)); on rejection draw the bonus token from the residual r(y) = max(p_t(y) - q(y), 0) / Z.
Hence P(draft x and reject it) = max(q(x) - p_t(x), 0), the total rejection probability is
1 - a = sum_x max(q(x) - p_t(x), 0), and the residual does not depend on which x was rejected.

Cache at a rejection depth (Sec. 4.1): the top-F tokens of the draft's ranking distribution (its logits z),
excluding the drafted token x, which cannot be the bonus token since r(x) = 0 whenever x can be rejected.
So the hit probability given a rejection at this depth is

    P(hit | reject) = sum_x max(q(x) - p_t(x), 0) r(S_F(x)) / sum_x max(q(x) - p_t(x), 0),
    S_F(x) = top_F(rank \\ {x}).

Thm 15 uses the cache S = top_F(z) without the exclusion; then P(hit | reject) = r(S) = in / (in + out), which
is non-increasing in C (more hits as C -> 0). That monotonicity needs the fixed S: with the exclusion rule the
set of rejectable tokens (weights max(q - p_t, 0)) moves with C, and lowering C can lower the hit rate (e.g.
p_draft = (.18, .39, .36, .07), p_t = (.08, .15, .54, .23), F = 1: 0.374 at C = 1, 0.154 at C = 0.5).
Convention (paper): if no rejection is possible, P(hit | reject) = 1.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "APPENDIX_CONSTRUCTION",
    "top_f_mask",
    "saguaro_probs",
    "acceptance_rate",
    "rejection_mass",
    "residual_distribution",
    "hit_probability_on_rejection",
    "saguaro_hit_rate_on_rejection",
    "hit_probability_one_token",
]

#: Appendix A, Construction 1: with F = 2 and C = 47/147, p_draft becomes (0.47, 0.47, 0.03, 0.03);
#: acceptance stays 0.98 while the hit rate on rejection rises from 0.5 to 1.
APPENDIX_CONSTRUCTION = {
    "p_target": (0.48, 0.48, 0.02, 0.02),
    "p_draft": (0.49, 0.49, 0.01, 0.01),
    "p_draft_saguaro": (0.47, 0.47, 0.03, 0.03),
    "C": 47.0 / 147.0,
    "F": 2,
    "acceptance": 0.98,
    "hit_rate_plain": 0.5,
    "hit_rate_saguaro": 1.0,
}


def _dist(p, name: str) -> np.ndarray:
    p = np.asarray(p, dtype=float)
    if p.ndim != 1 or p.size == 0 or np.any(p < 0) or not np.isclose(p.sum(), 1.0, atol=1e-9):
        raise ValueError(f"{name} must be a 1-D probability vector")
    return p


def top_f_mask(p, F: int, exclude: int | None = None) -> np.ndarray:
    """Boolean mask of the F most probable tokens of ``p`` (ties broken toward the lower index), skipping the
    token ``exclude`` if given. Works along the last axis of a batch of vectors when ``exclude`` is None."""
    p = np.asarray(p, dtype=float)
    if F < 0:
        raise ValueError("F must be >= 0")
    order = np.argsort(-p, axis=-1, kind="stable")
    if exclude is not None:
        if p.ndim != 1:
            raise ValueError("exclude needs a single distribution")
        order = order[order != exclude]
    mask = np.zeros(p.shape, dtype=bool)
    np.put_along_axis(mask, order[..., :F], True, axis=-1)
    return mask


def saguaro_probs(p_draft, F: int, C: float) -> np.ndarray:
    """Def. 14: sigma_{F,C}(z) proportional to C exp(z_t) on top_F(z) and exp(z_t) elsewhere.

    On probabilities p = softmax(z): multiply the top-F entries by C and renormalize (last axis). C = 1 gives
    p back; C = 0 removes the top-F tokens entirely (needs mass outside them).
    """
    if not 0.0 <= C <= 1.0:
        raise ValueError(f"C must lie in [0, 1], got {C}")
    p = np.asarray(p_draft, dtype=float)
    w = np.where(top_f_mask(p, F), C * p, p)
    z = w.sum(axis=-1, keepdims=True)
    if np.any(z <= 0):
        raise ValueError("no probability mass left after down-weighting")
    return w / z


def acceptance_rate(p_target, q) -> float:
    """Thm 1: a = sum_x min(p_t(x), q(x)) = 1 - TV(p_t, q) = 1 - ||p_t - q||_1 / 2."""
    return float(np.minimum(_dist(p_target, "p_target"), _dist(q, "q")).sum())


def rejection_mass(p_target, q) -> np.ndarray:
    """P(draft token x and reject it) = q(x) (1 - min(1, p_t(x)/q(x))) = max(q(x) - p_t(x), 0)."""
    return np.maximum(_dist(q, "q") - _dist(p_target, "p_target"), 0.0)


def residual_distribution(p_target, q) -> np.ndarray:
    """Bonus-token law after a rejection: r = max(p_t - q, 0) / sum max(p_t - q, 0).

    If p_t == q no rejection can happen; p_t is returned then (any choice is harmless).
    """
    p = _dist(p_target, "p_target")
    u = np.maximum(p - _dist(q, "q"), 0.0)
    s = u.sum()
    return p.copy() if s <= 1e-15 else u / s


def hit_probability_on_rejection(p_target, q, F: int, rank_by=None, exclude_drafted: bool = True) -> float:
    """P(bonus token in cache | the drafted token was rejected), see the module docstring.

    ``rank_by`` -- distribution whose top-F forms the cache (the draft's unmodified p_draft = softmax(z);
    defaults to q). ``exclude_drafted`` -- cache = top-F excluding the drafted token x (the engine's and the
    Appendix construction's rule); False gives Thm 15's fixed S = top_F(z).
    """
    p = _dist(p_target, "p_target")
    q = _dist(q, "q")
    rank = q if rank_by is None else _dist(rank_by, "rank_by")
    rej = rejection_mass(p, q)
    total = rej.sum()
    if total <= 1e-15:
        return 1.0
    r = residual_distribution(p, q)
    if not exclude_drafted:
        return float(r[top_f_mask(rank, F)].sum())
    hit = sum(rej[x] * r[top_f_mask(rank, F, exclude=x)].sum() for x in np.nonzero(rej > 0)[0])
    return float(hit / total)


def saguaro_hit_rate_on_rejection(
    p_target, p_draft, F: int, C: float, F_cache: int | None = None, exclude_drafted: bool = True
) -> tuple[float, float]:
    """Acceptance rate and P(hit | reject) when drafting from sigma_{F,C}(p_draft) with the cache ranked by
    p_draft (top ``F_cache``, default F). Returns ``(acceptance, hit_on_rejection)``: the trade-off of Thm 15."""
    q = saguaro_probs(p_draft, F, C)
    hit = hit_probability_on_rejection(p_target, q, F if F_cache is None else F_cache, p_draft, exclude_drafted)
    return acceptance_rate(p_target, q), hit


def hit_probability_one_token(p_target, q, F0: int, p_target_next, rank_next, F1: int, rank_by=None) -> float:
    """Unconditional cache-hit probability for a one-token speculation (K = 1).

    The draft proposes x ~ q. Outcome (0, t*): x rejected (prob max(q(x) - p_t(x), 0)), t* ~ r, hit iff
    t* in top_F0(rank_by without x). Outcome (1, t*): x accepted (prob min(q(x), p_t(x))), t* ~
    p_target_next[x] (the target's next-token law after x), hit iff t* in top_F1(rank_next[x]) (the draft's
    next-position distribution; nothing is excluded at depth K). Summing over x:

        P(hit) = sum_x [ max(q(x) - p_t(x), 0) r(S_F0(x)) + min(q(x), p_t(x)) p_target_next[x](top_F1(rank_next[x])) ].

    ``p_target_next`` and ``rank_next`` are V x V arrays (row x = context extended by x).
    """
    p = _dist(p_target, "p_target")
    q = _dist(q, "q")
    V = p.size
    nxt = np.asarray(p_target_next, dtype=float)
    rnk = np.asarray(rank_next, dtype=float)
    if nxt.shape != (V, V) or rnk.shape != (V, V):
        raise ValueError("p_target_next and rank_next must be V x V")
    rej = rejection_mass(p, q)
    reject_part = hit_probability_on_rejection(p, q, F0, rank_by) * rej.sum()
    acc = np.minimum(p, q)
    accept_part = float(np.sum(acc * (nxt * top_f_mask(rnk, F1)).sum(axis=1)))
    return float(reject_part + accept_part)
