"""The speculation cache: verification outcome -> speculation prepared in advance."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CachedSpeculation:
    tokens: list[int]  # drafted after the outcome's bonus token (may be shorter than K if the build was cut short)
    probs: torch.Tensor | None  # [len(tokens), V] distributions they were drawn from; None for greedy rows


class SpeculationCache:
    """Keyed by (sequence id, accepted count k, bonus token t*); rebuilt every round."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], CachedSpeculation] = {}

    def put(self, seq_id: int, k: int, token: int, spec: CachedSpeculation) -> None:
        self._entries[(seq_id, k, token)] = spec

    def get(self, seq_id: int, k: int, token: int) -> CachedSpeculation | None:
        return self._entries.get((seq_id, k, token))

    def drop(self, seq_id: int) -> None:
        for key in [key for key in self._entries if key[0] == seq_id]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
