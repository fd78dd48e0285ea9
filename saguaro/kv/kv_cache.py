"""The paged KV cache tensors of one model.

Slots are ``block * block_size + offset``; the block manager hands out blocks and the
model writes/reads slots. Layers share one big tensor so the cache is a single allocation. On the CPU
its pages become resident as requests write them (``host_memory.lazy_zeros``): an idle cache of 32,768
tokens costs next to nothing, where zeroing it up front made all of it resident (0.9 GB for the 1.5B).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
        into its sequence's own blocks)."""
        dst_index = torch.tensor(dst, dtype=torch.long, device=self.data.device)
        src_index = torch.tensor(src, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, dst_index, self.data.index_select(2, src_index))
