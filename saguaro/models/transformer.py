"""Decoder-only transformer covering Llama, Qwen2 and Qwen3.

Parameter names follow the HF checkpoints (``model.layers.0.self_attn.q_proj.weight``…)
so safetensors load directly and GGUF loaders only rename. The forward pass takes a flat
batch of new tokens plus ``AttentionMetadata`` and attends through the paged KV cache, so
prefill, decode, verification and tree drafting are all the same call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata
from saguaro.models.model_config import ModelConfig
from saguaro.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, H, D]; caches: [slots, KVH, D]. Returns [N, H, D]."""
    groups, max_q = meta.query_index.shape
    if meta.uniform:
        qg = q.view(groups, max_q, *q.shape[1:])
    else:
        qg = q[meta.query_index]
    k = k_cache[meta.context_slots].transpose(1, 2)  # [S, KVH, L, D]
    v = v_cache[meta.context_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qg.transpose(1, 2), k, v, attn_mask=meta.mask[:, None],
                                         scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)  # [S, Q, H, D]
    if meta.uniform:
        return out.reshape(q.shape)
    return out[meta.query_valid]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = kv
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def embedding(vocab: int, hidden: int) -> nn.Embedding:
    """An embedding table; built on the meta device (to be loaded), its random initialisation is skipped: a
    normal draw on meta tensors imports torch's compiler stack, 2-3 s in every process that loads a model."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
    return nn.Embedding(vocab, hidden)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    taps: tuple[int, ...] = ()  # layers whose input residual stream a pass keeps (an EAGLE-3 draft's features)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tapped: torch.Tensor | None = None  # [N, len(taps) * hidden] from the last pass, when taps are set
        self.model = Backbone(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [N, hidden] for N new tokens; their k/v land in ``cache``. With ``taps``, the input of
        each tapped layer is kept in ``tapped`` (concatenated in tap order)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        kept = {}
        for i, layer in enumerate(self.model.layers):
            if i in self.taps:
                kept[i] = x
            x = layer(x, cos, sin, cache.layer(i), meta)
        if self.taps:
            self.tapped = torch.cat([kept[i] for i in self.taps], -1)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given hidden rows (only the rows we sample from)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
