"""The adaptive chooser's prices against the rounds it chose: per K verified, the speedup over AR it predicted
when it chose that K, and what those rounds gave (their tokens over their time counted in AR steps).

Read from one request run alone through SSD, whose decoder times every round (``rounds.SSDRounds``). The K
chosen in a round is verified in the next one; a request's first round admits it and verifies nothing; a round
lasts until the next one starts (the request's last: its verification and wait). The AR step is the AR row's
on the same prompt (``bench adapt``), so a round at K = 0 that gives less than 1 costs more than AR's step.

    realized gain at K = sum(tokens) / sum(seconds / AR step)     over the rounds that verified K
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class RoundPrice:
    k: int  # the K the round verified
    predicted: float  # the speedup over AR the chooser predicted for it
    tokens: int  # what the verification gave the request
    seconds: float  # from the round's start to the next one's


def round_prices(rounds: list[dict[str, Any]], k_per_round: list[int], gain_per_round: list[float]
                 ) -> list[RoundPrice]:
    """One request's rounds (``rounds.SSDRounds`` dicts, from its admission), those that verified a K the
    chooser priced."""
    out = []
    for j, r in enumerate(rounds):
        if j == 0 or r["emitted"] is None or j > min(len(k_per_round), len(gain_per_round)):
            continue
        end = rounds[j + 1]["start"] if j + 1 < len(rounds) else r["start"] + (r["verify_ms"] + r["wait_ms"]) / 1e3
        out.append(RoundPrice(k_per_round[j - 1], gain_per_round[j - 1], r["emitted"], end - r["start"]))
    return out


def price_table(requests: list[tuple[list[dict[str, Any]], float]]) -> list[dict[str, Any]]:
    """Per K verified, over ``requests`` (each: its rounds as ``RoundPrice`` dicts, and the AR step in seconds
    on its prompt): the rounds, the mean predicted gain and the realized one."""
    by_k: dict[int, list[tuple[RoundPrice, float]]] = {}
    for rounds, ar_step in requests:
        for r in rounds:
            price = RoundPrice(**r)
            by_k.setdefault(price.k, []).append((price, ar_step))
    rows = []
    for k in sorted(by_k):
        at = by_k[k]
        steps = sum(p.seconds / ar_step for p, ar_step in at)
        rows.append({"k": k, "rounds": len(at), "predicted": sum(p.predicted for p, _ in at) / len(at),
                     "realized": sum(p.tokens for p, _ in at) / steps if steps > 0 else None})
    return rows


def as_dicts(prices: list[RoundPrice]) -> list[dict[str, Any]]:
    return [asdict(p) for p in prices]
