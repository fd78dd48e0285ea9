"""The dense backends: the exact eager reference and the bf16 CPU kernels.

Both read ``AttentionMetadata`` (every slot a group reads, and a boolean mask). The eager model
gathers each group's context and runs SDPA with the mask; it is the reference every other path is
tested against, and what ``enforce_eager=True`` runs. The CPU kernels (``backends/cpu_kernels/model.py``)
read the same metadata from C++.
"""
from __future__ import annotations

import torch

from saguaro.backends import metadata
from saguaro.backends.base import Backend
from saguaro.backends.batch import ForwardItem
from saguaro.device import to_device
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata


class DenseBackend(Backend):
    def __init__(self, net, device: torch.device, name: str):
        super().__init__(net, device)
        self.name = name

    def prepare(self, items: list[ForwardItem], block_size: int) -> AttentionMetadata:
        return metadata.dense(items, block_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        dev = self.device
        hidden = self.net(to_device(input_ids, dev), to_device(positions, dev), cache, meta.to(dev))
        if logit_rows.numel() == 0:
            return None
        return self.net.logits(hidden[to_device(logit_rows, dev)])
