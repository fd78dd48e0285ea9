"""The paged KV cache tensors of one model.

Slots are ``block * block_size + offset``; the block manager hands out blocks and the
model writes/reads slots. Layers share one big tensor so the cache is a single allocation.
"""
from __future__ import annotations

import torch

from saguaro.models.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * itemsize
