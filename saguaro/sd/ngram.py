"""N-gram (prompt-lookup) speculation: propose what followed the current suffix earlier in the text.

Rule, shared by the reference function and the incremental index: for ``n`` from ``max_ngram`` down to
``min_ngram``, take the last ``n`` tokens (the suffix) and look for an earlier occurrence of them, i.e.
one that starts before ``len(tokens) - n`` (occurrences may overlap the suffix). The first ``n`` with an
occurrence wins; among its occurrences the most recent (latest start) wins, and the proposal is the up
to ``k`` tokens that followed it. Since an earlier occurrence ends before the last token, at least one
token follows it; fewer than ``k`` follow when it ends near the end of the text. With no occurrence
for any ``n`` the proposal is empty.

The proposal is deterministic and has no distribution: verify it as a point-mass draft.
"""
from __future__ import annotations

from typing import Sequence


def _check(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def propose_ngram(tokens: Sequence[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Reference implementation (quadratic scan); :class:`NgramIndex` gives the same answers faster."""
    _check(max_ngram, min_ngram)
    tokens = list(tokens)
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class NgramIndex:
    """Incremental n-gram lookup over a growing token sequence (prompt + generated text).

    For each ``n`` in ``min_ngram .. max_ngram`` it maps an n-gram to the stack of positions where its
    earlier occurrences end (exclusive end index). Only n-grams ending strictly before the last token
    are indexed, so the suffix never matches itself, and the top of each stack is the most recent
    occurrence. ``extend`` costs ``O(#new tokens * #n)``, ``truncate`` the same per removed token, and
    ``propose`` ``O(#n + k)``.
    """

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = 4, min_ngram: int = 1) -> None:
        _check(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def _index_end(self, end: int) -> None:
        for n, table in self._ends.items():
            if end >= n:
                table.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def _unindex_end(self, end: int) -> None:
        for n, table in self._ends.items():
            if end >= n:
                key = tuple(self.tokens[end - n : end])
                stack = table[key]
                stack.pop()  # ends are pushed in increasing order, so `end` is on top
                if not stack:
                    del table[key]

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens (e.g. the accepted drafts and the bonus token of a round)."""
        old_len = len(self.tokens)
        self.tokens.extend(int(t) for t in new_tokens)
        # Ends old_len .. len-1 become "earlier" positions (the end at len is the suffix itself).
        for end in range(max(old_len, 1), len(self.tokens)):
            self._index_end(end)

    def truncate(self, length: int) -> None:
        """Drop every token from position ``length`` on."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} tokens to {length}")
        for end in range(len(self.tokens) - 1, max(length, 1) - 1, -1):
            self._unindex_end(end)
        del self.tokens[length:]

    def follow(self, tokens: Sequence[int]) -> None:
        """Catch up with a sequence's ``tokens`` (it only grew since the last call), or index them afresh
        when the history was rewritten (a re-admitted sequence)."""
        if len(self) > len(tokens) or self.tokens[-1:] != list(tokens[len(self) - 1:len(self)]):
            self.truncate(0)
        self.extend(tokens[len(self):])

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest, most recent earlier match of the suffix."""
        length = len(self.tokens)
        if k <= 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length < n + 1:
                continue
            stack = self._ends[n].get(tuple(self.tokens[length - n :]))
            if stack:
                end = stack[-1]
                return self.tokens[end : end + k]
        return []
