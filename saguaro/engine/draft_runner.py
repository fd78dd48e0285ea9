"""``DraftRunner``: what a draft's runner offers the SSD speculator and an SD proposer.

A draft model's ``ModelRunner`` and an EAGLE-3 head's ``EagleRunner`` both declare it. The speculator drives
either through these alone: ``forward`` over ``ForwardItem``s against the runner's paged KV cache (its
``cache`` and ``blocks``), ``slots`` of a block table, graphs captured at start-up. ``reads_features`` says
whether the runner's rows read the target's features (an EAGLE-3 head): the messages then bring them, and
after an outcome the speculator keeps only the rows built on them.
"""
from __future__ import annotations

from typing import Protocol

import torch

from saguaro.backends.batch import ForwardItem
from saguaro.kv.block_manager import BlockManager, slots_for
from saguaro.kv.kv_cache import KVCache
from saguaro.models.model_config import ModelConfig


class DraftRunner(Protocol):
    config: ModelConfig  # vocab_size: the vocabulary its logits live on (the target's)
    device: torch.device
    cache: KVCache
    blocks: BlockManager
    reads_features: bool = False

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """The KV slots of positions [start, end) of a sequence with block table ``table``."""
        return slots_for(table, start, end, self.block_size)

    def forward_flat(self, items: list[ForwardItem]) -> tuple[torch.Tensor | None, list[int]]:
        """The pass's wanted logits as one tensor [R, V] (items in order), with each wanting item's row count."""
        ...

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        """One batched forward pass; returns per item logits [rows, V] (None for "none")."""
        logits, counts = self.forward_flat(items)
        if logits is None:
            return [None] * len(items)
        parts = iter(logits.split(counts))
        return [next(parts) if item.logits != "none" else None for item in items]

    def capture_graphs(self, max_rows: int | None = None, extras: tuple[int, ...] = (0,)) -> None:
        """Capture what the runner replays now, at start-up, so that no round captures."""
        ...

    def close(self) -> None:
        ...
