"""The paged KV cache tensors of one model.

Slots are ``block * block_size + offset``; the block manager hands out blocks and the
model writes/reads slots. Layers share one big tensor so the cache is a single allocation. On the CPU
its pages become resident as requests write them (``host_memory.lazy_zeros``): an idle cache of 32,768
tokens costs next to nothing, where zeroing it up front made all of it resident (0.9 GB for the 1.5B).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from saguaro.device import to_device
from saguaro.host_memory import lazy_zeros

if TYPE_CHECKING:  # a hint only: models use the cache, not the other way round
    from saguaro.models.model_config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        on_cpu = torch.device(device).type == "cpu"
        self.data = lazy_zeros(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy every layer's k/v from slots ``src`` to slots ``dst`` (e.g. a speculation branch's scratch
        into its sequence's own blocks). The slots cross to a GPU in one copy from pinned memory that the host
        does not wait for (``to_device``): a hit's adoption queues behind the build without a sync."""
        index = to_device(torch.tensor([src, dst], dtype=torch.long), self.data.device)
        self.data.index_copy_(2, index[1], self.data.index_select(2, index[0]))
