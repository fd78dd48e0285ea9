"""Tensors on a device: host data copied to a GPU without blocking the host, a batch's distributions stacked
with zero padding, and several tensors' values read back in one read."""
from __future__ import annotations

import math

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` without blocking the host: a CUDA copy from pageable memory
    waits for every kernel queued before it, so host data goes through pinned memory, asynchronously
    (the caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def stack_padded(blocks: list[torch.Tensor | None], width: int, columns: int, device: torch.device) -> torch.Tensor:
    """[len(blocks), width, columns] float32 on ``device``: block b ([n_b <= width, columns]; None: none) in row b,
    zeros past it. One stack and one copy when every block is full (a batch's speculations usually are)."""
    if blocks and all(b is not None and len(b) == width for b in blocks):
        return to_device(torch.stack(blocks).float(), device)
    out = torch.zeros(len(blocks), width, columns, device=device)
    for i, block in enumerate(blocks):
        if block is not None and len(block):
            out[i, :len(block)] = to_device(block, device)
    return out


def read_together(tensors: list[torch.Tensor]) -> list[list]:
    """The Python values of several tensors in one read from their device (on a GPU one sync, not one per
    tensor): flattened, joined as float64 (exact for token ids and float32 values), read once, split, and
    nested back into each tensor's shape (integers for integer and bool tensors; a 0-d tensor gives a
    one-element list). The tensors must share one device."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        values = flat[start:start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            values = list(map(int, values))
        out.append(_nest(values, tuple(t.shape)))
    return out


def _nest(values: list, shape: tuple[int, ...]) -> list:
    if len(shape) <= 1:
        return values
    step = math.prod(shape[1:])
    rows = [values[i * step:(i + 1) * step] for i in range(shape[0])]  # a [rows, width] table: no recursion
    return rows if len(shape) == 2 else [_nest(row, shape[1:]) for row in rows]
