"""What follows a cache miss: the tokens of the round after a miss, for each miss strategy (calibration).

A miss is not a random round. The cache misses where the draft misjudged the target, and those are the
stretches where *any* speculator does worse: fresh code after an echoed signature, a word the draft did
not see coming. So the tokens a miss strategy delivers after a miss are fewer than its average over all
rounds. Taken unconditionally, the n-gram backup looks nearly as good as the draft on code (echoed
prompts are its best case), and the policy would pick it at batch 1, where it is measurably slower.

From the primary calibration run (every speculation drafted by the draft, empty cache) each round is
annotated with what the round after it delivers, per miss strategy:

* ``jit``: the draft's next speculation, as it ran: that round's accepted tokens + 1.
* ``ngram``: the n-gram backup's proposal from the same context, replayed offline against the tokens the
  target actually produced: matched prefix + 1. For a deterministic proposal d_1..d_n this has the law of
  the verifier's accepted count: both accept d_1 with probability p(d_1), then go on from the same context.

A fan-out F then selects the rounds that would have missed (rank of the outcome >= F at its depth), and
the mean over those is the conditional E_miss the policy uses (``miss_tokens``).
"""
from __future__ import annotations

from collections import defaultdict

from saguaro.calibration.profile import Source
from saguaro.sd.ngram import NgramIndex
from saguaro.ssd_settings import DraftedBy, MissStrategy

MIN_MISS_ROUNDS = 8  # fewer misses than this in the calibration run: use the unconditional estimate
COLUMNS = ("depth", "rank", "jit", "ngram")  # one row per primary round (see follow_ups)


def _matched(proposal: list[int], actual: list[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(actual) and proposal[n] == actual[n]:
        n += 1
    return n


def follow_ups(records: list, sequences: dict[int, list[int]], k: int) -> list[list[int]]:
    """Rows [depth, rank, jit tokens, n-gram tokens] for every ranked primary round that has a next round
    and K + 1 known tokens after it. ``records`` are ``RankRecord``s with ``seq_id`` and ``length``;
    ``sequences`` the final prompt + output of each sequence."""
    by_seq: dict[int, list] = defaultdict(list)
    for r in records:
        if r.drafted_by == DraftedBy.PRIMARY and r.seq_id >= 0:
            by_seq[r.seq_id].append(r)
    rows = []
    for seq_id, recs in by_seq.items():
        tokens = sequences[seq_id]
        recs.sort(key=lambda r: r.length)
        index = NgramIndex()
        for r, after in zip(recs, recs[1:]):
            if r.rank < 0 or r.length + k + 1 > len(tokens):
                continue
            index.extend(tokens[len(index):r.length])
            ngram = _matched(index.propose(k), tokens[r.length:r.length + k]) + 1
            depth = r.accepted if r.accepted < r.drafted else k
            rows.append([depth, r.rank, after.accepted + 1, ngram])
    return rows


def miss_tokens(source: Source, fan_out: list[int], strategy: MissStrategy) -> float | None:
    """Mean tokens of the round after a miss with ``fan_out`` (None: no annotated rounds, or too few misses).
    ``strategy``: jit or ngram."""
    rows = source.follow_ups
    column = COLUMNS.index(strategy)  # MissStrategy values are the column names
    k = len(fan_out) - 1
    missed = [row[column] for row in rows if row[1] >= fan_out[min(row[0], k)]]
    return sum(missed) / len(missed) if len(missed) >= MIN_MISS_ROUNDS else None
