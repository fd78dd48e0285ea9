"""The per-row paged form of attention: what every query row reads, and the checks both kernels share.

``saguaro/kv/metadata.py`` describes attention per *group* with a dense ``[S, Q, L]`` mask. That
is exact and general, but the mask is built on the host and grows with the context; a GPU kernel
wants something it can read row by row inside a CUDA graph. The per-row form says the same thing
with O(1) numbers per row (plus the few tree slots), so the same buffers serve every replay:

    q            [N, H, D]       query rows (all sequences' new tokens, flat), H = KVH * G heads
    k_cache      [slots, KVH, D] one layer's keys; slot = block * block_size + offset
    v_cache      [slots, KVH, D] one layer's values
    block_tables [S, MB] int32   block ids of each group (sequence); entries past its length are arbitrary
    row_group    [N] int32       the block-table row that query row r reads
    prefix_len   [N] int32       row r sees positions 0 .. prefix_len[r]-1 of its group, where
                                 slot(p) = block_tables[g, p // block_size] * block_size + p % block_size
    extra_slots  [N, E] int64    raw cache slots row r sees as well (E may be 0): an SSD branch's own
    extra_len    [N] int32       tokens, which live in scratch slots outside the block table; row r
                                 sees extra_slots[r, :extra_len[r]]
    returns      [N, H, D]       in q's dtype

Cases (the new tokens' k/v is written to the cache before attention, so a row sees itself):

* causal prefill, decode, K+1-token verification: prefix_len[r] = position[r] + 1, E = 0;
* SSD tree step j, branch q forking at depth k after a verified prefix of length L
  (``saguaro/ssd/tree.py``, ``BranchLayout.step_item``):
  prefix_len = L + k, extras = the branch's own scratch slots of steps 0..j;
* ghost rows (padding a CUDA graph's batch bucket): prefix_len = extra_len = 0; their output is 0, never NaN,
  and their row_group and extra slots are never read.

Query head h reads kv head h // G (the ``enable_gqa`` convention of ``F.scaled_dot_product_attention``).
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_dense_rows(name: str, t: torch.Tensor) -> None:
    """A per-row vector [N] that a kernel reads at ``pointer + row`` must be dense. An expanded view (stride 0,
    as ``x[:, None].expand(1, w).reshape(-1)`` gives) holds one element: a Triton kernel would read past it."""
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be dense (stride 1): the kernels read it by row; got stride {t.stride(0)} "
                         f"(an expanded view? make it .contiguous())")


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     row_group: torch.Tensor, prefix_len: torch.Tensor, extra_slots: torch.Tensor,
                     extra_len: torch.Tensor, block_size: int, out: torch.Tensor | None) -> None:
    """Shape, dtype and device checks. Host metadata only (no values are read), so it is safe inside a graph capture."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [N, H, D] and k/v caches [slots, KVH, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads of dim {dim} cannot read {kv_heads} kv heads of dim {k_cache.shape[2]}")
    if q.dtype not in FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one of {FLOAT_DTYPES}; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or extra_slots.dim() != 2 or extra_slots.shape[0] != n:
        raise ValueError(f"block_tables must be [S, MB] and extra_slots [N={n}, E]; got "
                         f"{tuple(block_tables.shape)}, {tuple(extra_slots.shape)}")
    for name, t in (("row_group", row_group), ("prefix_len", prefix_len), ("extra_len", extra_len)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [N={n}], got {tuple(t.shape)}")
        check_dense_rows(name, t)
    for name, t in (("block_tables", block_tables), ("row_group", row_group), ("prefix_len", prefix_len),
                    ("extra_slots", extra_slots), ("extra_len", extra_len)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    tensors = (q, k_cache, v_cache, block_tables, row_group, prefix_len, extra_slots, extra_len)
    if any(t.device != q.device for t in tensors):
        raise ValueError("all attention inputs must be on one device")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
