"""The fused per-layer ops of the GPU model, written op for op in torch: the reference.

The GPU model (fused qkv and gate_up projections, CUDA graphs) calls three elementwise ops per
layer besides its GEMMs and attention. Each has two implementations with one signature: this
module, and the Triton kernels of :mod:`saguaro.backends.paged.ops_triton` (one launch per op). This one
repeats the eager model's ops (:mod:`saguaro.models.transformer`, :mod:`saguaro.models.rope`)
one for one, in the same order and dtypes, so in float32 it equals the eager model **bitwise**
(``tests/test_ops_fused.py``); the kernels are tested against it.

Terms
-----
* ``N``: the new tokens of one forward pass, all sequences flattened (as in
  :class:`~saguaro.kv.metadata.AttentionMetadata`); ``H``, ``KVH``, ``D``: query heads, key/value
  heads, head dim; ``dtype``: the model's dtype (float32, bfloat16 or float16).
* **Residual stream** ``s``: the running hidden state that every sublayer adds its output to.
  The eager layer computes ``x = x + attn(norm(x))``; the fused model hands the sublayer output
  and the stream to :func:`rms_norm`, which adds them and normalizes in one pass.
* **Ghost row**: a padding row of a CUDA graph batch bucket. Its ``slot_mapping`` entry is negative
  and its cache write goes nowhere; its other outputs are computed and ignored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from saguaro.backends.paged.attention_rows import check_dense_rows
from saguaro.models.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the residual stream, with the residual add fused in front.

    x, residual: [..., hidden] in the model dtype (residual: the stream before this sublayer's
    output ``x`` is added); weight: [hidden]. Returns ``(y, s)``: ``s = residual + x`` (or ``x``
    itself when ``residual`` is None), added in the model dtype as the eager ``x + sublayer(x)``
    does, and ``y = RMSNorm(s)`` with the numerics of ``transformer.RMSNorm``: statistics in
    float32, rounded to the dtype before the weight multiply. Works on any leading shape, so it
    also serves as the per-head q/k norm of Qwen3.
    """
    s = x if residual is None else residual + x
    dtype = s.dtype
    t = s.float()
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return weight * t.to(dtype), s


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [N, D] in ``dtype``, the same ops as ``rope.RotaryEmbedding.forward``.

    positions: [N] int64; inv_freq: [D // 2] float32 (``rope.inverse_frequencies``, scaling included).
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k, v: [N, KVH, D] to the caches at ``slot_mapping`` [N]; ghost rows (slot < 0) write nothing.

    The eager ``Attention.forward`` write (``index_copy_``) with fixed shapes, so that it is capturable
    (``capture_check.py``): selecting the real rows would size the write by values. Instead a ghost row
    repeats the first real row's write (the same slot, the same value, so the duplicate is harmless); in
    a pass of ghosts only, every row writes slot 0's own value back.
    """
    if slot_mapping.shape[0] == 0:
        return
    real = slot_mapping >= 0
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    first_real = real.to(torch.int8).argmax()  # 0 when no row is real
    source = torch.where(real, rows, first_real)
    any_real = real.any()
    slots = torch.where(any_real, slot_mapping[source], 0)
    for cache, new in ((k_cache, k), (v_cache, v)):
        values = torch.where(any_real, new[source].to(cache.dtype), cache[0])
        cache.index_copy_(0, slots, values)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """Split a fused qkv projection, rotate q and k, write k and v to the paged cache; return q.

    qkv: [N, (H + 2 KVH) D], columns q | k | v, bias already added; positions: [N] int64;
    inv_freq: [D // 2] float32; k_cache, v_cache: [slots, KVH, D]; slot_mapping: [N] int64, the
    cache slot of each row's k/v (< 0: a ghost row, nothing written). q_norm, k_norm: [D] weights
    of Qwen3's per-head RMSNorm, applied before the rotation (both or neither). Returns the rotated
    q, [N, H, D] in the model dtype. The rotation is the HF "rotate half" one of ``rope.apply_rotary``.
    """
    n = qkv.shape[0]
    check_dense_rows("positions", positions)  # as the Triton kernel reads them
    check_dense_rows("slot_mapping", slot_mapping)
    q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_cols, kv_cols, kv_cols], dim=-1)
    q = q.reshape(n, num_heads, head_dim)
    k = k.reshape(n, num_kv_heads, head_dim)
    v = v.reshape(n, num_kv_heads, head_dim)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (Qwen3's qk-norm) or not at all")
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps)[0], rms_norm(k, k_norm, eps)[0]
    cos, sin = rope_cos_sin(positions, inv_freq, qkv.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    store_kv(k_cache, v_cache, slot_mapping, k, v)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise half: gate_up [N, 2 I] = cat(gate, up) -> silu(gate) * up, [N, I].

    In the model dtype, as the eager ``MLP.forward`` computes it. ``gate`` is made contiguous first
    because that is the layout eager's ``F.silu`` sees (the output of ``gate_proj``): torch's CPU
    kernels take a scalar path on the tail of a row and a vector path elsewhere, and the two may
    round ``exp`` differently, so the layout decides the bits.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.contiguous()) * up
