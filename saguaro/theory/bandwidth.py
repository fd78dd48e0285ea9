"""A ceiling on SSD's speed when the target and the draft share one memory bus.

Thm 2 measures time in verifications and takes the draft's device to be independent of the
target's. On this project's CPU testbed the two "devices" are two cores behind one memory bus,
and at batch 1 every forward pass streams its model's weights once. A round
then costs at least its bytes over the bandwidth it can get, and SSD's overlap can only hide
draft time the bus has room for.

Symbols (SI units: bytes, seconds, bytes per second):

* ``W_t`` -- bytes one target verification streams: its weights. KV cache and activations are
  left out; they are small at these contexts, and leaving them out only raises the ceiling.
* ``W_d`` -- bytes one draft pass streams. A tree step of many rows streams the weights once,
  since they do not fit in cache.
* ``B_2`` -- the total bandwidth of the bus while both cores stream at once.
* ``T_v`` -- one verification of K+1 tokens with the other core idle, as measured.
* ``P`` -- draft passes per SSD round. To have a K-token speculation ready after a round that
  accepted everything, the draft must feed d_K (its distribution gives the bonus guesses), the
  bonus guess and the next K-1 drafted tokens, one after another: P >= K+1. Ordinary SD makes K
  passes per round, since the target supplies the bonus token.

**Round floor.** An SSD round in which every speculation is already cached lasts at least

    max(T_v, (W_t + P W_d) / B_2),

because a busy neighbour never speeds up the verification, and all the round's bytes cross the
one bus. With Saguaro sampling off (C = 1) and the same draft, a cached K-token speculation is
accepted exactly as SD's would be, and shorter ones yield fewer tokens. So SSD's decode speed at
lookahead K is at most E_SD(K) over that floor (``ssd_tok_s_ceiling``). Misses, cut-short builds
and tapered trees only lower it further.

**Corollary: the bus cap.** Suppose both passes run at B_1, the bandwidth one core reaches alone
(T_v = W_t / B_1 and T_d = W_d / B_1, so SD's round lasts (W_t + K W_d) / B_1). Then

    SSD / SD  <=  (W_t + K W_d) / max(W_t, (W_t + (K+1) W_d) B_1 / B_2)  <=  min(1 + K W_d / W_t, B_2 / B_1):

SSD can hide no more than the draft's share of SD's round, and can use no more of the bus than
the second core adds. (If the first term of the max is the larger, the ratio is 1 + K W_d / W_t
and B_2 / B_1 exceeds it; otherwise the ratio is B_2 / B_1 times a factor below 1, and
B_2 / B_1 < 1 + (K+1) W_d / W_t keeps it below 1 + K W_d / W_t.) Where the bus gives two cores
together little more than one core alone, no fan-out, hit rate or draft makes SSD much faster
than SD (``bus_cap``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["ssd_round_floor", "ssd_tok_s_ceiling", "bus_cap"]


def _out(x):
    x = np.asarray(x, dtype=float)
    return float(x) if x.ndim == 0 else x


def _positive(**values) -> None:
    for name, v in values.items():
        if np.any(np.asarray(v, dtype=float) <= 0):
            raise ValueError(f"{name} must be > 0")


def ssd_round_floor(verify_s, target_bytes, draft_bytes, draft_passes, bus_total):
    """Shortest possible SSD round (seconds): max(T_v, (W_t + P W_d) / B_2).

    ``verify_s``: T_v, the verification alone; ``target_bytes``: W_t; ``draft_bytes``: W_d per pass;
    ``draft_passes``: P; ``bus_total``: B_2 in bytes per second.
    """
    _positive(verify_s=verify_s, target_bytes=target_bytes, bus_total=bus_total)
    if np.any(np.asarray(draft_bytes, dtype=float) < 0) or np.any(np.asarray(draft_passes, dtype=float) < 0):
        raise ValueError("draft bytes and passes must be >= 0")
    traffic = np.asarray(target_bytes, dtype=float) + np.asarray(draft_passes, dtype=float) * np.asarray(
        draft_bytes, dtype=float)
    return _out(np.maximum(np.asarray(verify_s, dtype=float), traffic / np.asarray(bus_total, dtype=float)))


def ssd_tok_s_ceiling(tokens_per_round, verify_s, target_bytes, draft_bytes, k, bus_total, draft_passes=None):
    """Upper bound on SSD's decode tokens per second at lookahead K: E_SD(K) / ``ssd_round_floor``.

    ``tokens_per_round``: E_SD(K), SD's tokens per round with the same draft and K (measured or
    ``expected_tokens``). ``draft_passes`` defaults to K+1, the fewest that keep a K-token speculation
    ready for every round.
    """
    k = np.asarray(k, dtype=float)
    if np.any(k < 1):
        raise ValueError("lookahead K must be >= 1")
    passes = k + 1.0 if draft_passes is None else np.asarray(draft_passes, dtype=float)
    floor = ssd_round_floor(verify_s, target_bytes, draft_bytes, passes, bus_total)
    return _out(np.asarray(tokens_per_round, dtype=float) / floor)


def bus_cap(target_bytes, draft_bytes, k, bus_alone, bus_total):
    """The bus cap on SSD / SD at one lookahead K for both, every pass at full bandwidth (corollary above):

        (W_t + K W_d) / max(W_t, (W_t + (K+1) W_d) B_1 / B_2).

    ``bus_alone``: B_1, one core streaming alone; ``bus_total``: B_2, both cores streaming together.
    """
    _positive(target_bytes=target_bytes, bus_alone=bus_alone, bus_total=bus_total)
    wt, wd, k = (np.asarray(v, dtype=float) for v in (target_bytes, draft_bytes, k))
    sd_round = (wt + k * wd) / np.asarray(bus_alone, dtype=float)
    floor = ssd_round_floor(wt / np.asarray(bus_alone, dtype=float), wt, wd, k + 1.0, bus_total)
    return _out(sd_round / floor)
