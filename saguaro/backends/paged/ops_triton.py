"""The fused per-layer ops of the GPU model as Triton kernels: one launch per op.

Same signatures and semantics as the torch reference :mod:`saguaro.backends.paged.ops_torch` (its docstring
has the terms: N, H, KVH, D, residual stream, ghost row). The eager model launches about 40 small
kernels per layer (RMSNorm alone is 7), which makes a decode step launch-bound even inside a CUDA
graph; these replace them with three launches besides the GEMMs and attention:

* ``rms_norm``: the residual add and the norm, one program per row;
* ``rope_and_store``: q/k norm (Qwen3), rotary on q and k, and both cache writes, one program per row;
* ``silu_mul``: SwiGLU's ``silu(gate) * up``, one program per row and block of columns.

Numerics. Everything is computed in float32, and rounded to the model dtype exactly where the
eager model rounds (after ``residual + x``, after ``cos``/``sin``, after each product of the
rotation and of the norm weight, after ``silu``), because that is what the eager model computes:
a bf16 ``a * b`` in torch is the float32 product rounded once. For the same reason the kernels are
compiled without floating-point contraction (``enable_fp_fusion=False``): eager's ``x * cos +
r * sin`` is three kernels, each rounding, never one fused multiply-add. On a GPU the
transcendentals (cos, sin, exp) are libdevice's, the functions torch's own CUDA kernels call,
rather than Triton's fast ``exp`` (whose error grows with the argument). So a kernel differs from
the reference only in the order of a float32 sum (the norms) and in the last bit of ``rsqrt``:
equal within float32 rounding in float32, and within one rounding of the dtype otherwise, where a
16-bit result differs at all only when that float32 difference straddles a rounding boundary
(rarely: the tests bound the share of such elements).

CUDA graphs. No host sync, no data-dependent shape: launch grids and block sizes come from
tensor shapes alone, outputs are allocated from shapes (a captured allocation comes from the
graph's pool), and ghost rows are masked inside the kernel. Call each op once before capturing,
so that Triton compiles outside the capture.

Without a GPU, the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, read when this
module is imported) on CPU tensors, which is how CI tests them. The interpreter has no libdevice,
so there the transcendentals are numpy's; and it truncates float32 to bfloat16 instead of
rounding to nearest, so its bfloat16 results may differ from a GPU's by one unit in the last place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from saguaro.backends.paged.attention_rows import check_dense_rows

# Decided once, like triton.jit itself decides at decoration time whether to interpret.
_LIBDEVICE = not triton.knobs.runtime.interpret


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round float32 ``x`` to the model dtype and back: where eager stores a dtype tensor."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, s_ptr, x_stride, res_stride, hidden, inv_hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row; the whole row fits in one block (hidden <= a few thousand)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = x.dtype
    t = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        t = _round(r.to(tl.float32) + t, dtype)
        tl.store(s_ptr + row * hidden + cols, t.to(dtype), mask=mask)
    inv = tl.rsqrt(tl.sum(t * t, axis=0) * inv_hidden + eps)  # the mean as torch's CUDA mean: sum * (1/n)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * hidden + cols, (_round(t * inv, dtype) * w).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, hidden]; weight: [hidden]. Returns (RMSNorm(s), s), s = residual + x (or x).

    The same contract as ``ops_torch.rms_norm``, restricted to 2-D inputs whose rows are
    contiguous; with no residual, ``s`` is ``x`` itself (no copy).
    """
    _check_rows("x", x)
    hidden = x.shape[1]
    _check_vector("weight", weight, hidden, x)
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty_like(y)
    if x.shape[0]:
        res = x if residual is None else residual  # a placeholder pointer when there is no residual
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x.shape[0],)](
            x, res, weight, y, s, x.stride(0), res.stride(0), hidden, 1.0 / hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False)
    return y, s


@triton.jit
def _norm_and_rotate(a, b, w_ptr, half_cols, half_mask, cos, sin, eps, HALF, dtype: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    """Rotate heads ``[a | b]`` (a, b: [heads, D/2] float32, the two halves); optionally RMSNorm first.

    rotate_half(x) = [-b | a], so x * cos + rotate_half(x) * sin = [a cos - b sin | b cos + a sin],
    each product rounded to the dtype before the sum as in eager (and -round(p) = round(-p)).
    """
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) * (1.0 / (2 * HALF)) + eps)[:, None]
        w_a = tl.load(w_ptr + half_cols, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        w_b = tl.load(w_ptr + HALF + half_cols, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        a = _round(_round(a * inv, dtype) * w_a, dtype)
        b = _round(_round(b * inv, dtype) * w_b, dtype)
    out_a = _round(a * cos, dtype) - _round(b * sin, dtype)
    out_b = _round(b * cos, dtype) + _round(a * sin, dtype)
    return out_a.to(dtype), out_b.to(dtype)


@triton.jit
def _rope_and_store_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_ptr,
                           q_norm_ptr, k_norm_ptr, qkv_stride, cache_slot_stride, cache_head_stride, eps,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                           HAS_NORM: tl.constexpr, LIBDEVICE: tl.constexpr):
    # one program per row: all its q heads, k heads and v heads, so cos/sin are computed once
    row = tl.program_id(0).to(tl.int64)
    base = qkv_ptr + row * qkv_stride
    dtype = qkv_ptr.dtype.element_ty
    head_dim = 2 * HALF
    half_cols = tl.arange(0, BLOCK_HALF)
    half_mask = half_cols < HALF

    # cos/sin of RotaryEmbedding: angle = float(position) * inv_freq, rounded to the dtype
    angle = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + half_cols, mask=half_mask, other=0.0)
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    cos = _round(cos, dtype)[None, :]
    sin = _round(sin, dtype)[None, :]

    heads = tl.arange(0, BLOCK_H)
    offs = heads[:, None] * head_dim + half_cols[None, :]
    mask = (heads < NUM_HEADS)[:, None] & half_mask[None, :]
    a = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    a, b = _norm_and_rotate(a, b, q_norm_ptr, half_cols, half_mask, cos, sin, eps, HALF, dtype, HAS_NORM)
    q_row = q_ptr + row * (NUM_HEADS * head_dim)
    tl.store(q_row + offs, a, mask=mask)
    tl.store(q_row + HALF + offs, b, mask=mask)

    slot = tl.load(slot_ptr + row).to(tl.int64)
    kv_heads = tl.arange(0, BLOCK_KV)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & half_mask[None, :]
    write_mask = kv_mask & (slot >= 0)  # ghost rows write nothing
    k_base = base + NUM_HEADS * head_dim
    kv_offs = kv_heads[:, None] * head_dim + half_cols[None, :]
    cache_offs = slot * cache_slot_stride + kv_heads[:, None] * cache_head_stride + half_cols[None, :]
    a = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    b = tl.load(k_base + HALF + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    a, b = _norm_and_rotate(a, b, k_norm_ptr, half_cols, half_mask, cos, sin, eps, HALF, dtype, HAS_NORM)
    cache_dtype = k_cache_ptr.dtype.element_ty  # eager writes k.to(k_cache.dtype)
    tl.store(k_cache_ptr + cache_offs, a.to(cache_dtype), mask=write_mask)
    tl.store(k_cache_ptr + HALF + cache_offs, b.to(cache_dtype), mask=write_mask)

    v_base = k_base + NUM_KV_HEADS * head_dim
    for part in tl.static_range(2):  # the two halves, so one tile shape serves the whole row
        v = tl.load(v_base + part * HALF + kv_offs, mask=kv_mask, other=0.0)
        tl.store(v_cache_ptr + part * HALF + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=write_mask)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """qkv: [N, (H + 2 KVH) D] -> rotated q [N, H, D]; rotated k and v land in the caches at slot_mapping.

    The contract of ``ops_torch.rope_and_store``; qkv rows and the caches' last dim must be
    contiguous (the caches may be views with any slot and head strides).
    """
    _check_rows("qkv", qkv)
    n = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns; expected (num_heads + 2 * num_kv_heads) * head_dim "
                         f"= ({num_heads} + 2 * {num_kv_heads}) * {head_dim} with an even head_dim")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (n,) or t.dtype.is_floating_point or t.device != qkv.device:
            raise ValueError(f"{name} must be an integer [{n}] tensor on {qkv.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
        check_dense_rows(name, t)
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32 or inv_freq.device != qkv.device:
        raise ValueError(f"inv_freq must be float32 [{head_dim // 2}] on {qkv.device}, got "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (num_kv_heads, head_dim) or cache.stride(2) != 1 \
                or cache.device != qkv.device:
            raise ValueError(f"{name} must be [slots, {num_kv_heads}, {head_dim}] with contiguous rows on "
                             f"{qkv.device}, got {tuple(cache.shape)} strides {cache.stride()} on {cache.device}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (Qwen3's qk-norm) or not at all")
    if q_norm is not None:
        _check_vector("q_norm", q_norm, head_dim, qkv)
        _check_vector("k_norm", k_norm, head_dim, qkv)
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        half = head_dim // 2
        block_h, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
        _rope_and_store_kernel[(n,)](
            qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, q,
            qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm,  # placeholders without norm
            qkv.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_H=block_h, BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
            HAS_NORM=q_norm is not None, LIBDEVICE=_LIBDEVICE, num_warps=_warps(block_h * block_half),
            enable_fp_fusion=False)
    return q


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, inter, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    # program (row, block of columns): gate and up of those columns sit `inter` apart in the row
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptr = gate_up_ptr + row * gate_up_stride + cols
    g = tl.load(gate_ptr, mask=mask, other=0.0)
    dtype = g.dtype
    g = g.to(tl.float32)
    u = tl.load(gate_ptr + inter, mask=mask, other=0.0).to(tl.float32)
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    silu = tl.div_rn(g, 1.0 + e)  # torch's silu: x / (1 + exp(-x)) in float32, rounded to the dtype
    tl.store(out_ptr + row * inter + cols, (_round(silu, dtype) * u).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 I] = cat(gate, up) -> silu(gate) * up, [N, I] (the contract of ``ops_torch.silu_mul``)."""
    _check_rows("gate_up", gate_up)
    n, cols = gate_up.shape
    if cols % 2:
        raise ValueError(f"gate_up has an odd number of columns ({cols}); expected cat(gate, up)")
    inter = cols // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), inter, BLOCK=block, LIBDEVICE=_LIBDEVICE, num_warps=4,
            enable_fp_fusion=False)
    return out


def _warps(tile: int) -> int:
    """Warps for a program holding ``tile`` float32 values: about 8 per thread, which keeps a whole
    row in registers without spilling (checked with ptxas for sm_90 up to 16384 values)."""
    return min(max(tile // 256, 4), 16)


def _check_rows(name: str, t: torch.Tensor) -> None:
    """The kernels index rows by a stride and columns densely: [N, C] with stride(1) == 1."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be a 2-D tensor with contiguous rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got {t.dtype}")


def _check_vector(name: str, w: torch.Tensor, size: int, like: torch.Tensor) -> None:
    """A norm weight: [size], contiguous, in the model dtype (eager's weight * x stays in that dtype)."""
    if w.shape != (size,) or w.stride(0) != 1 or w.dtype != like.dtype or w.device != like.device:
        raise ValueError(f"{name} must be a contiguous {like.dtype} [{size}] tensor on {like.device}, got "
                         f"{tuple(w.shape)} {w.dtype} on {w.device}")
