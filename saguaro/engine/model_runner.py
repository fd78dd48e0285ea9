"""Runs one model on one device over its own paged KV cache.

Callers describe each sequence's slice of a forward pass as a ``ForwardItem`` (new tokens,
where they start, the sequence's block table, which logits they want). The runner turns
those into flat input ids, positions and attention metadata, runs the model once, and
hands back float32 logits per item. Target and draft each own one runner.

With ``fast=True`` (``Config.compile``) a bf16 model on a CPU with AVX512-BF16 runs through
``FastCausalLM`` (packed weights, C++ kernels; see saguaro/models/fast_forward.py) instead
of the eager module; anything else (fp32, other CPUs) stays eager, so fp32 results are
exactly the eager ones either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.kv.block_manager import BlockManager, slots_for
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata, build_metadata
from saguaro.models.fast_forward import fast_or_eager
from saguaro.models.transformer import CausalLM


@dataclass
class ForwardItem:
    token_ids: list[int]  # new tokens, written to the cache at positions start..start+n-1
    start: int
    block_table: list[int]  # must already cover start + n positions
    logits: str = "last"  # "last", "all" or "none"


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: str = "cpu", fast: bool = False,
                 weights: str = "bf16", head_ids: torch.Tensor | None = None):
        self.model = model
        # what forward passes run through; quantized weights and a reduced head are for drafts only
        self.net = fast_or_eager(model, weights, head_ids) if fast else model
        self.config = model.config
        self.device = torch.device(device)
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(self.config, num_blocks, block_size, dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        return slots_for(table, start, end, self.block_size)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        """One batched forward pass; returns per item logits [rows, V] (None for "none")."""
        ids: list[int] = []
        positions: list[int] = []
        contexts: list[list[int]] = []
        for item in items:
            n = len(item.token_ids)
            ids += item.token_ids
            positions += range(item.start, item.start + n)
            contexts.append(self.slots(item.block_table, 0, item.start + n))
        meta = build_metadata(contexts, [len(i.token_ids) for i in items])
        return self.run(ids, positions, meta, items)

    def run(self, ids: list[int], positions: list[int], meta: AttentionMetadata,
            items: list[ForwardItem]) -> list[torch.Tensor | None]:
        hidden = self.net(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                          self.cache, meta.to(self.device))
        rows: list[int] = []
        spans: list[tuple[int, int] | None] = []
        offset = 0
        for item in items:
            n = len(item.token_ids)
            if item.logits == "none":
                spans.append(None)
            else:
                first = offset + n - 1 if item.logits == "last" else offset
                spans.append((len(rows), len(rows) + offset + n - first))
                rows += range(first, offset + n)
            offset += n
        logits = self.net.logits(hidden[rows]).cpu() if rows else None
        return [None if s is None else logits[s[0]:s[1]] for s in spans]
