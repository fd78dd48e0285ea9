"""Per-row paged attention in plain torch: the CPU stand-in for the GPU kernel, and its reference.

Each query row gathers the cache slots it may read (its prefix through the block table, then its
extra slots) into a ``[rows, W, KVH, D]`` copy, masks what lies past its lengths, and runs softmax
in float32. That is the dense copy the Triton kernel avoids, so this is not a fast path: it is
the same contract (``attention_rows.py``) in a few batched ops, for CI and for the CUDA-graph runner's
CPU stand-in. Its shapes come from shapes only (every row gathers the block table's whole capacity,
masked past its own length), never from values, so it is capturable too (``capture_check.py``); the
length checks that read values run only outside a capture.

Rows are processed in chunks so that a long prefill (N rows, each up to N positions) does not
materialize an N x N x KVH x D copy at once; the chunk loop runs a handful of times, never once per row.
"""
from __future__ import annotations

import torch

from saguaro.backends.paged.attention_rows import check_paged_args
from saguaro.backends.paged.capture_check import capturing

CHUNK_ELEMENTS = 1 << 24  # gathered k (or v) elements per chunk of rows: 64 MB in float32


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, row_group: torch.Tensor, prefix_len: torch.Tensor,
                          extra_slots: torch.Tensor, extra_len: torch.Tensor, block_size: int, scale: float,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every query row over its paged prefix and its extra slots. Shapes: ``attention_rows.py``."""
    check_paged_args(q, k_cache, v_cache, block_tables, row_group, prefix_len, extra_slots, extra_len,
                     block_size, out)
    if out is None:
        out = torch.empty_like(q)
    n, heads, dim = q.shape
    if n == 0:
        return out
    max_prefix = block_tables.shape[1] * block_size  # the table's capacity: a shape, not a value
    max_extra = extra_slots.shape[1]
    if not capturing():
        _check_lengths(prefix_len, extra_len, max_prefix, max_extra, block_tables.shape[1], block_size)
    width = max(1, (max_prefix + max_extra) * k_cache.shape[1] * dim)
    chunk = max(1, CHUNK_ELEMENTS // width)
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        out[rows] = _attend(q[rows], k_cache, v_cache, block_tables, row_group[rows], prefix_len[rows],
                            extra_slots[rows], extra_len[rows], block_size, scale, max_prefix)
    return out


def _check_lengths(prefix_len: torch.Tensor, extra_len: torch.Tensor, max_prefix: int, max_extra: int,
                   blocks: int, block_size: int) -> None:
    """Value checks (they read the lengths on the host, so a capture skips them)."""
    if int(prefix_len.min()) < 0 or int(extra_len.min()) < 0 or int(extra_len.max()) > max_extra:
        raise ValueError(f"lengths out of range: prefix_len >= 0 and 0 <= extra_len <= E={max_extra} required")
    if int(prefix_len.max()) > max_prefix:
        raise ValueError(f"prefix_len {int(prefix_len.max())} exceeds the block table ({blocks} blocks "
                         f"of {block_size})")


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            row_group: torch.Tensor, prefix_len: torch.Tensor, extra_slots: torch.Tensor, extra_len: torch.Tensor,
            block_size: int, scale: float, max_prefix: int) -> torch.Tensor:
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    slots, visible = _visible_slots(block_tables, row_group, prefix_len, extra_slots, extra_len, block_size,
                                    max_prefix)  # [n, W] each
    k = k_cache[slots].float()  # [n, W, KVH, D]
    v = v_cache[slots].float()
    qg = q.float().view(n, kv_heads, heads // kv_heads, dim)  # [n, KVH, G, D]: head h reads kv head h // G
    scores = torch.einsum("nkgd,nwkd->nkgw", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a ghost row sees nothing: keep exp() at 0, not NaN
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    o = torch.einsum("nkgw,nwkd->nkgd", weights, v) / torch.where(total > 0, total, 1.0)
    return o.reshape(n, heads, dim).to(q.dtype)


def _visible_slots(block_tables: torch.Tensor, row_group: torch.Tensor, prefix_len: torch.Tensor,
                   extra_slots: torch.Tensor, extra_len: torch.Tensor, block_size: int,
                   max_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slot of every (row, position) and whether the row sees it; unseen entries point at slot 0.

    slots [n, max_prefix + E] long: the row's prefix positions through its block table, then its extra slots
    visible [n, max_prefix + E] bool
    Block-table entries past a group's length and extra slots past extra_len may hold anything
    (e.g. -1), so they are replaced before they index the cache.
    """
    device = prefix_len.device
    pos = torch.arange(max_prefix, device=device)
    in_prefix = pos[None, :] < prefix_len[:, None].long()  # [n, P]
    group = torch.where(prefix_len > 0, row_group.long(), 0)  # a row that sees no prefix may name any group
    blocks = block_tables[group][:, pos // block_size].long()  # [n, P]
    prefix_slots = torch.where(in_prefix, blocks * block_size + pos % block_size, 0)
    in_extra = torch.arange(extra_slots.shape[1], device=device)[None, :] < extra_len[:, None].long()  # [n, E]
    own_slots = torch.where(in_extra, extra_slots.long(), 0)
    return torch.cat([prefix_slots, own_slots], 1), torch.cat([in_prefix, in_extra], 1)
