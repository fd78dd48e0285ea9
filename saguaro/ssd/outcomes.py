"""predict_verify_outcomes (paper Sec. 4.1): which (k, t*) outcomes to prepare for."""
from __future__ import annotations

from collections.abc import Sequence


def predict_outcomes(ranked: Sequence[Sequence[int]], speculation: list[int],
                     fan_out: list[int]) -> list[tuple[int, int]]:
    """Top-F_k bonus-token guesses at each depth k.

    ``ranked[k]`` lists the draft's token ids after the prefix and d_1..d_k, most likely first
    (k = 0..len(speculation); at least F_k + 1 of them). At depth k < len(speculation) the
    drafted token d_{k+1} is excluded: if it were the target's choice it would have been
    accepted, so it can never be the bonus token there.
    """
    outcomes = []
    for k in range(len(speculation) + 1):
        f = fan_out[min(k, len(fan_out) - 1)] if k < len(speculation) else fan_out[-1]
        if f <= 0:
            continue
        top = list(ranked[k][:f + 1])
        if k < len(speculation):
            top = [t for t in top if t != speculation[k]]
        outcomes += [(k, t) for t in top[:f]]
    return outcomes
