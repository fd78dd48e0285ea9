"""The GPU forward pass: the same model as ``CausalLM``, in a few fused ops per layer.

Why: at batch 1 a decode step should cost its weight bytes over the memory bandwidth, but the
eager model launches about forty small kernels per layer (RMSNorm alone is seven), so on a GPU it
is bound by launches even inside a CUDA graph. Here each layer is

    rms_norm(+residual) -> qkv GEMM -> rope_and_store -> paged attention -> o GEMM
    -> rms_norm(+residual) -> gate_up GEMM -> silu_mul -> down GEMM

with q/k/v and gate/up fused into one matrix each. The ops come in two implementations with one
signature (``ops_for``): Triton kernels on CUDA, and torch references that follow the eager model
op by op, so on the CPU this class computes what ``CausalLM`` does (it runs there only in tests,
to check the paged metadata and the CUDA-graph bookkeeping without a GPU).

Attention reads ``PagedMetadata`` (block tables and per-row visibility), whose buffers have fixed
shapes per row count, so the whole pass can be captured as a CUDA graph (``backends/paged/graphs.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from saguaro.kv.kv_cache import KVCache
from saguaro.backends.paged.metadata import PagedMetadata
from saguaro.models.transformer import CausalLM


@dataclass(frozen=True)
class PagedOps:
    """One implementation of the fused ops (signatures in ``ops_*.py`` and ``attention_*.py``)."""
    name: str
    rms_norm: Callable  # (x, weight, eps, residual) -> (y, residual stream)
    rope_and_store: Callable  # (qkv, positions, inv_freq, k_cache, v_cache, slots, H, KVH, D, q_norm, k_norm, eps) -> q
    silu_mul: Callable  # (gate_up) -> silu(gate) * up
    attention: Callable  # paged attention over PagedMetadata's tensors


def ops_for(device: torch.device) -> PagedOps:
    """Triton kernels on CUDA; the torch references elsewhere."""
    if device.type == "cuda":
        from saguaro.backends.paged.attention_triton import paged_attention_triton
        from saguaro.backends.paged import ops_triton as f
        return PagedOps("triton", f.rms_norm, f.rope_and_store, f.silu_mul, paged_attention_triton)
    from saguaro.backends.paged.attention_torch import paged_attention_torch
    from saguaro.backends.paged import ops_torch as f
    return PagedOps("torch", f.rms_norm, f.rope_and_store, f.silu_mul, paged_attention_torch)


class _Layer:
    __slots__ = ("ln1", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "ln2", "gate_up", "down")


def _fuse(modules: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """One matrix (or bias) holding ``modules``' rows back to back; each module's own parameter becomes a
    view of it, so the eager model stays usable and the weights are not held twice."""
    parts = [getattr(m, attr) for m in modules]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for m, p in zip(modules, parts):
        setattr(m, attr, nn.Parameter(fused[start:start + p.shape[0]], requires_grad=False))
        start += p.shape[0]
    return fused


class PagedCausalLM:
    """``forward``/``logits`` with the signatures of ``CausalLM``, over ``PagedMetadata``."""
    taps: tuple[int, ...] = ()  # as CausalLM's: layers whose input a pass keeps in ``tapped``

    def __init__(self, model: CausalLM, ops: PagedOps):
        self.tapped: torch.Tensor | None = None
        self.config = cfg = model.config
        self.model = model
        self.ops = ops
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for block in model.model.layers:
                attn, mlp, layer = block.self_attn, block.mlp, _Layer()
                layer.ln1, layer.ln2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
                layer.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
                layer.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
                layer.q_norm = attn.q_norm.weight if cfg.qk_norm else None
                layer.k_norm = attn.k_norm.weight if cfg.qk_norm else None
                layer.o = attn.o_proj.weight
                layer.gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
                layer.down = mlp.down_proj.weight
                self.layers.append(layer)
        self.embed = model.model.embed_tokens.weight
        self.head = self.embed if cfg.tie_word_embeddings else model.lm_head.weight
        self.norm = model.model.norm.weight
        self.inv_freq = model.rotary.inv_freq
        self.scale = cfg.head_dim ** -0.5

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 meta: PagedMetadata) -> torch.Tensor:
        return self.forward(input_ids, positions, cache, meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: PagedMetadata) -> torch.Tensor:
        """Hidden states [N, hidden] for N new tokens; their k/v land in ``cache`` (ghost rows write nothing)."""
        cfg, ops = self.config, self.ops
        eps, n = cfg.rms_norm_eps, input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        residual, kept = None, {}
        for i, layer in enumerate(self.layers):
            h, residual = ops.rms_norm(x, layer.ln1, eps, residual)
            if i in self.taps:  # the stream entering layer i (both ops' norms return it fresh, never reused)
                kept[i] = residual
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = cache.layer(i)
            q = ops.rope_and_store(qkv, positions, self.inv_freq, k_cache, v_cache, meta.slot_mapping,
                                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer.q_norm, layer.k_norm, eps)
            attn = ops.attention(q, k_cache, v_cache, meta.block_tables, meta.row_group, meta.prefix_len,
                                 meta.extra_slots, meta.extra_len, meta.block_size, self.scale)
            x = F.linear(attn.reshape(n, -1), layer.o)
            h, residual = ops.rms_norm(x, layer.ln2, eps, residual)
            x = F.linear(ops.silu_mul(F.linear(h, layer.gate_up)), layer.down)
        if self.taps:
            self.tapped = torch.cat([kept[i] for i in self.taps], -1)
        return ops.rms_norm(x, self.norm, eps, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given hidden rows, as the eager head computes them."""
        return F.linear(hidden, self.head).float()
