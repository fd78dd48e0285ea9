"""The packed weight layout the CPU kernels read (csrc/common.h, csrc/quant_pack.h): sizes, views, packers.

A matrix [n, k] is packed in tiles of TILE outputs:
  * bf16: [K/2, 64, 2] values (pairs of k per output);
  * int8: [K/4, 64, 4] bytes, then the 64 outputs' fp32 scales;
  * int4: K/32 blocks of I4_BLOCK bytes (codes, then fp16 scales and offsets).
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

TILE = 64  # outputs per packed tile
I4_BLOCK = 32 * TILE // 2 + 4 * TILE  # int4 bytes per tile and block of 32 inputs


def tiles(rows: int) -> int:
    return -(-rows // TILE)


def matrix_bytes(n: int, k: int, weights: str) -> int:
    """Bytes of an [n, k] matrix packed as ``weights``."""
    per_tile = {"bf16": 2 * TILE * k, "int8": TILE * (k + 16), "int4": k // 32 * I4_BLOCK}[weights]
    return tiles(n) * per_tile


def packed_view(chunk: torch.Tensor, n: int, k: int, weights: str) -> torch.Tensor:
    """``chunk`` (uint8, ``matrix_bytes(n, k, weights)`` bytes) as the packed tensor the kernels take."""
    if weights == "int4":
        return chunk.view(tiles(n), k // 32, I4_BLOCK)
    if weights == "int8":
        return chunk.view(tiles(n), k // 4 + 4, TILE, 4)
    return chunk.view(torch.bfloat16).view(tiles(n), k // 2, TILE, 2)


def packer(ops: ModuleType, weights: str) -> Callable:
    """The kernels' packer of ``weights``: packer(dst, sources, epilogue)."""
    return {"bf16": ops.pack, "int8": ops.pack_i8, "int4": ops.pack_i4}[weights]


def packed_copies(ops: ModuleType, w: torch.Tensor, weights: str, at_least: int,
                  minimum: int = 4) -> list[torch.Tensor]:
    """Copies of ``w`` packed as ``weights`` in one huge-page allocation, at least ``minimum`` of them and
    ``at_least`` bytes in all: taken in turn, each 1-row GEMM streams its weights from memory, not a cache."""
    n, k = w.shape
    size = matrix_bytes(n, k, weights)
    copies = max(minimum, -(-at_least // size))
    arena = ops.alloc_huge(size * copies)
    out = [packed_view(arena[i * size:(i + 1) * size], n, k, weights) for i in range(copies)]
    packer(ops, weights)(out[0], [w], 0)
    for p in out[1:]:  # the same bytes: copied, not quantized again (int4 packs at tens of MB/s)
        p.copy_(out[0])
    return out
