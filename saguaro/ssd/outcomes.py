"""predict_outcomes (paper Sec. 4.1): which (k, t*) outcomes to prepare for, likeliest first."""
from __future__ import annotations

from collections.abc import Sequence

from saguaro.sampling.ranked import Ranked


def predict_outcomes(ranked: Sequence[Ranked], speculation: list[int],
                     fan_out: list[int]) -> list[tuple[int, int]]:
    """Top-F_k bonus-token guesses at each depth k, ordered by how likely the draft finds them.

    ``ranked[k]`` holds the draft's most likely ids after the prefix and d_1..d_k (k = 0..len(speculation);
    at least F_k + 1 of them) with their probabilities q_k. At depth k < len(speculation) the drafted token
    d_{k+1} is excluded: if it were the target's choice it would have been accepted, so it can never be the
    bonus token there.

    If the target behaved like the draft, outcome (k, t) would happen with probability
    q_0(d_1) ... q_{k-1}(d_k) q_k(t): accept d_1..d_k, then draw t instead of d_{k+1}. Outcomes come
    sorted by that estimate (ties keep depth order), so a tapered tree (``BranchLayout.widths``)
    extends the likeliest branches. The order never affects exactness, only which branches go deeper.
    """
    outcomes, scores = [], []
    reach = 1.0  # q_0(d_1) ... q_{k-1}(d_k)
    for k in range(len(speculation) + 1):
        f = fan_out[min(k, len(fan_out) - 1)] if k < len(speculation) else fan_out[-1]
        if f > 0:
            top = list(zip(ranked[k].ids[:f + 1], ranked[k].probs[:f + 1]))
            if k < len(speculation):
                top = [(t, p) for t, p in top if t != speculation[k]]
            outcomes += [(k, t) for t, _ in top[:f]]
            scores += [reach * p for _, p in top[:f]]
        if k < len(speculation):
            reach *= ranked[k].prob(speculation[k])
    order = sorted(range(len(outcomes)), key=lambda i: -scores[i])
    return [outcomes[i] for i in order]
