"""N-gram speculation: the reference rule, and the incremental index that must agree with it."""
from __future__ import annotations

import random
import time

import pytest

from saguaro.sd.ngram import NgramIndex, propose_ngram


def test_hand_examples():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=2) == [3, 4]
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=9) == [3, 4, 1, 2]  # the continuation may run into the suffix
    assert propose_ngram([5, 5, 5, 5], k=3) == [5]  # the occurrence at 0 of (5, 5, 5) ends right before the end
    assert propose_ngram([1, 2, 3], k=3) == []  # no earlier occurrence of any suffix
    assert propose_ngram([], k=3) == [] and propose_ngram([7], k=3) == []
    assert propose_ngram([1, 2, 1, 2], k=0) == []


def test_prefers_longest_then_most_recent():
    # Suffix (8, 9): the 2-gram occurred at 0 (followed by 1); the 1-gram 9 occurred later (followed by 2).
    tokens = [8, 9, 1, 9, 2, 8, 9]
    assert propose_ngram(tokens, k=1) == [1]
    assert propose_ngram(tokens, k=1, max_ngram=1) == [2]
    # Among occurrences of the same n-gram the latest wins.
    assert propose_ngram([3, 4, 0, 3, 4, 6, 3, 4], k=2) == [6, 3]
    # min_ngram excludes short matches.
    assert propose_ngram([1, 2, 3, 9, 3], k=2, min_ngram=2) == []
    assert propose_ngram([1, 2, 3, 9, 3], k=2, min_ngram=1) == [9, 3]
    with pytest.raises(ValueError):
        propose_ngram([1], k=1, max_ngram=1, min_ngram=2)


def _is_real_continuation(tokens: list[int], proposal: list[int], max_ngram: int, min_ngram: int) -> bool:
    """Some suffix of length in [min_ngram, max_ngram] occurs earlier and is followed by the proposal."""
    length = len(tokens)
    for n in range(min_ngram, max_ngram + 1):
        for start in range(0, length - n):
            if tokens[start : start + n] == tokens[length - n :] and \
                    tokens[start + n : start + n + len(proposal)] == proposal:
                return True
    return False


@pytest.mark.parametrize("vocab", [2, 3, 6, 40])
def test_proposals_are_real_earlier_continuations(vocab):
    rng = random.Random(vocab)
    for _ in range(200):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        k = rng.randrange(1, 6)
        proposal = propose_ngram(tokens, k)
        assert len(proposal) <= k
        if proposal:
            # It continues an earlier occurrence of the longest suffix (<= 4) that has one.
            longest = max(n for n in range(1, 5) if _is_real_continuation(tokens, [], n, n))
            assert _is_real_continuation(tokens, proposal, longest, longest)
        else:
            assert tokens == [] or tokens[-1] not in tokens[:-1]


@pytest.mark.parametrize("max_ngram,min_ngram", [(4, 1), (3, 2), (1, 1), (6, 3)])
def test_index_matches_reference_under_random_edits(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    for vocab in (2, 4, 30):
        index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram)
        tokens: list[int] = []
        for _ in range(400):
            op = rng.random()
            if op < 0.6:
                new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
                index.extend(new)
                tokens.extend(new)
            elif op < 0.8 and tokens:
                shorter = max(0, len(tokens) - rng.randrange(1, 5))
                length = rng.randrange(0, len(tokens) + 1) if rng.random() < 0.2 else shorter
                index.truncate(length)
                del tokens[length:]
            k = rng.randrange(0, 7)
            assert index.tokens == tokens and len(index) == len(tokens)
            assert index.propose(k) == propose_ngram(tokens, k, max_ngram, min_ngram)


def test_index_built_from_initial_tokens():
    rng = random.Random(3)
    tokens = [rng.randrange(5) for _ in range(300)]
    index = NgramIndex(tokens)
    for cut in range(300, 0, -7):
        index.truncate(cut)
        assert index.propose(4) == propose_ngram(tokens[:cut], 4)
    with pytest.raises(ValueError):
        index.truncate(len(index) + 1)


def test_index_is_fast_on_long_sequences():
    rng = random.Random(4)
    prompt = [rng.randrange(1000) for _ in range(4000)]
    start = time.perf_counter()
    index = NgramIndex(prompt)
    for _ in range(500):  # rounds: propose, accept some, append
        proposal = index.propose(5)
        accepted = proposal[: rng.randrange(0, len(proposal) + 1)]
        index.extend(accepted + [rng.randrange(1000)])
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{elapsed:.2f} s"
    assert index.propose(5) == propose_ngram(index.tokens, 5)
