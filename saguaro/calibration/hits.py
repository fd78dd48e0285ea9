"""Outcome laws and cache-hit rates per speculation length, from a profile's calibrated curves.

A *source* (``profile.Source``) is what a profile measured after one kind of speculation (primary or
backup): its acceptance, its outcome law over depths, and its per-depth hit curves p_hit^d(F) (Thm 13's curves).
Depth d < L means d tokens of an L-token speculation were accepted and the bonus token replaced d_{d+1};
the all-accepted outcome of any length is stored at index K, as the engine's fan-out lists do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from saguaro.calibration.profile import F_MAX, Source
from saguaro.theory import accepted_length_pmf, integer_geometric_fanout, optimal_fanout


def depth_curves(source: Source, k: int) -> list[np.ndarray]:
    """Hit curves for depths 0..k (index k = all accepted) from a profile calibrated at any K."""
    stored = [np.asarray(c, dtype=float) for c in source.hit_curves]
    kc = len(stored) - 1
    return [stored[min(d, kc - 1)] for d in range(k)] + [stored[kc]]


def depth_weights_for(source: Source, length: int) -> np.ndarray:
    """P(outcome at depth d), d = 0..length (d = length: all accepted), for speculations of ``length`` tokens.

    From the measured outcome distribution when the profile has one (acceptance is far from geometric in
    practice: it is bimodal, many rounds accept nothing or everything), truncated to ``length`` (accepting the
    first L tokens does not depend on later ones) and extended geometrically with a past the calibrated K;
    otherwise the capped geometric law of Thm 2 / Appendix A.
    """
    a = float(source.acceptance)
    pmf = np.asarray(source.outcome_pmf, dtype=float)
    if pmf.size < 2 or pmf.sum() <= 0:
        return accepted_length_pmf(a, length)
    pmf = pmf / pmf.sum()
    kc = pmf.size - 1
    if length <= kc:
        return np.r_[pmf[:length], pmf[length:].sum()]
    tail = pmf[kc]
    return np.r_[pmf[:kc], [tail * a ** (j - kc) * (1 - a) for j in range(kc, length)], tail * a ** (length - kc)]


def expected_round_tokens(source: Source, length: int) -> float:
    """E: accepted drafts plus the bonus token per round, sum_d P(d) (d + 1)."""
    w = depth_weights_for(source, length)
    return float(np.dot(w, np.arange(1, length + 2)))


def backup_weights(source: Source, k: int) -> np.ndarray:
    """Depth law after a backup speculation (its proposals vary in length): the measured ``depth_pmf``."""
    w = np.asarray(source.depth_pmf, dtype=float)
    return w / w.sum() if w.size == k + 1 and w.sum() > 0 else depth_weights_for(source, k)


def deep_share(source: Source, fan_out: list[int], length: int, deep: int, weights: np.ndarray | None = None) -> float:
    """The share of the cache's hit probability carried by its ``deep`` likeliest (depth, rank) outcomes
    (``weights``: the outcome law over depths 0..K, as for ``hit_rate``; default the source's)."""
    k = len(fan_out) - 1
    curves = depth_curves(source, k)
    w = depth_weights_for(source, length) if weights is None else np.r_[weights[:length], weights[length:].sum()]
    scores = []
    for i, d in enumerate(list(range(length)) + [k]):
        f = min(fan_out[d], len(curves[d]) - 1)
        scores += list(w[i] * np.diff(curves[d][:f + 1]))
    total = float(sum(scores))
    return float(sum(sorted(scores, reverse=True)[:deep])) / total if total > 0 else 0.0


def hit_rate(source: Source, fan_out: list[int], length: int, weights: np.ndarray | None = None) -> float:
    """p_hit = sum_d P(d) p_hit^d(F_d) for speculations of ``length`` tokens (Appendix A, proof of Thm 13)."""
    k = len(fan_out) - 1
    curves = depth_curves(source, k)
    depths = list(range(length)) + [k]
    w = depth_weights_for(source, length) if weights is None else np.r_[weights[:length], weights[length:].sum()]
    hits = [curves[d][min(fan_out[d], len(curves[d]) - 1)] for d in depths]
    return float(min(1.0, max(0.0, np.dot(w, hits))))


def verified_mix(source: Source, fan_out: list[int], steps: int, deep_steps: int, k: int,
                 deep: int) -> tuple[float, float]:
    """(p_hit, deep share of the hits) over the lengths of the speculations the target actually verifies.

    The speculation under verification is as long as where it came from: a hit on an ordinary branch
    carries ``steps`` tokens, a hit on one of the ``deep`` likeliest branches of a tapered tree
    ``deep_steps``, and a miss's just-in-time drafting K. Each length has its own outcome law, so its own
    hit rate h_L and deep share s_L. The lengths form a Markov chain (from L: a shallow hit with probability
    h_L (1 - s_L), a deep hit h_L s_L, a miss 1 - h_L); the rates are averaged over its stationary law.
    Taking every speculation to be ``steps`` long instead overstates a tapered tree's hits: its deep
    branches and its misses make long speculations, whose all-accepted outcome is far less likely."""
    lengths = sorted({steps, deep_steps, k})
    h = {n: hit_rate(source, fan_out, n) for n in lengths}
    s = {n: deep_share(source, fan_out, n, deep) if deep_steps > steps else 0.0 for n in lengths}
    index = {n: i for i, n in enumerate(lengths)}
    move = np.zeros((len(lengths), len(lengths)))
    for n in lengths:
        move[index[n], index[steps]] += h[n] * (1 - s[n])
        move[index[n], index[deep_steps]] += h[n] * s[n]
        move[index[n], index[k]] += 1 - h[n]
    # stationary law: pi (move - I) = 0 with sum(pi) = 1
    system = np.vstack([(move - np.eye(len(lengths))).T, np.ones(len(lengths))])
    pi = np.linalg.lstsq(system, np.r_[np.zeros(len(lengths)), 1.0], rcond=None)[0]
    p_hit = float(sum(pi[index[n]] * h[n] for n in lengths))
    deep_hits = float(sum(pi[index[n]] * h[n] * s[n] for n in lengths))
    return p_hit, deep_hits / p_hit if p_hit > 0 else 0.0


def fan_out_for_budget(source: Source, length: int, k: int, budget: int, vocab: int,
                       weights: np.ndarray | None = None) -> tuple[list[int], str]:
    """F_0..F_K for speculations of ``length`` tokens: Thm 12 if the power law fits, else Thm 13."""
    a = float(source.acceptance)
    curves = depth_curves(source, k)
    caps = [min(vocab - 1, F_MAX)] * length + [min(vocab, F_MAX)]
    depths = list(range(length)) + [k]
    if weights is None:
        weights = depth_weights_for(source, length)
    else:  # weights over depths 0..K: keep the depths a length-L speculation can land on
        weights = np.r_[weights[:length], weights[length:].sum()]
    sub = [curves[d][:caps[i] + 1] for i, d in enumerate(depths)]
    budget = int(min(budget, sum(caps)))
    r = source.r
    if source.power_law and 0.0 < a < 1.0 and r and r > 0:
        f = integer_geometric_fanout(a, r, length, budget, max_fanout=caps)
        method = "thm12-geometric"
    else:
        f = optimal_fanout(sub, budget, weights=weights)
        method = "thm13-empirical"
    f = [int(x) for x in f]
    return f[:length] + [0] * (k - length) + [f[length]], method


def fan_out_candidates(primary: Source, steps: int, deep_steps: int, k: int, budget: int,
                       vocab: int) -> list[tuple[list[int], str]]:
    """The fan-outs worth predicting for ``budget`` branches, with how each was chosen. A fan-out spreads the
    budget over one speculation length's outcomes; the verified speculations mix the cached length
    (``steps``), a tapered tree's deep length and a miss's K (``verified_mix``): one candidate for each."""
    lengths = sorted({n for n in (steps, deep_steps, k) if n >= 1})
    found = dict.fromkeys((tuple(f), m) for f, m in (fan_out_for_budget(primary, n, k, budget, vocab)
                                                     for n in lengths))
    return [(list(f), m) for f, m in found]


@dataclass
class HitSide:
    """What the hits of one pair of fan-outs deliver (Thm 2's hit side)."""
    p_hit_p: float  # after a primary speculation
    p_hit_b: float  # after a backup speculation
    deep_share: float  # share of hits that land on a tapered tree's deep branches
    e_hit: float  # tokens of a hit round
    e_all: float  # tokens of a round verifying a K-token primary speculation (a just-in-time miss's)


def hit_side(primary: Source, backup: Source, f_p: list[int], f_b: list[int], steps: int, deep_steps: int, k: int,
             deep: int) -> HitSide:
    p_p, share = verified_mix(primary, f_p, steps, deep_steps, k, deep)
    p_b = hit_rate(backup, f_b, k, backup_weights(backup, k))
    e_hit = (1 - share) * expected_round_tokens(primary, steps) + share * expected_round_tokens(primary, deep_steps)
    # weighted sums of per-depth rates that are all 1 can land an ulp above it
    return HitSide(min(float(p_p), 1.0), min(float(p_b), 1.0), share, e_hit, expected_round_tokens(primary, k))
