"""The speculation cache: verification outcome -> speculation prepared in advance."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.sampling.ranked import Ranked, RankTable


@dataclass
class CachedSpeculation:
    tokens: list[int]  # drafted after the outcome's bonus token (may be shorter than K if the build was cut short)
    probs: torch.Tensor | None  # [len(tokens), V] distributions they were drawn from; None for greedy rows
    # rows ``rank_rows`` of ``rank_table``: the draft's most likely ids at the position each token was drawn
    # for (the next build's outcome guesses at depth j, so that build need not re-run these positions)
    rank_table: RankTable | None = None
    rank_rows: list[int] | None = None
    # scratch KV slots of the bonus token and tokens[:-1] (what the next build's glue would recompute)
    kv_slots: list[int] | None = None

    def ranked(self) -> list[Ranked] | None:
        return None if self.rank_table is None else self.rank_table.rows(self.rank_rows)


class SpeculationCache:
    """Keyed by (sequence id, accepted count k, bonus token t*); rebuilt every round."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], CachedSpeculation] = {}

    def put(self, seq_id: int, k: int, token: int, spec: CachedSpeculation) -> None:
        self._entries[(seq_id, k, token)] = spec

    def get(self, seq_id: int, k: int, token: int) -> CachedSpeculation | None:
        return self._entries.get((seq_id, k, token))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
