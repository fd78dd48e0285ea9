"""The EAGLE-3 head: one Llama decoder layer over (token embedding, target feature), and a reduced LM head.

Shapes (N rows, H the head's width, H_t the target's, A taps, V_d the draft vocabulary):
  project:  target features [N, A*H_t] -> fc -> [N, H]       (the first step of a round)
  forward:  token ids [N], features [N, H] -> pre-norm hidden [N, H]
            attention input concat(input_layernorm(embed), hidden_norm(feature)) [N, 2H]; the feature is the
            residual stream (or its normed form, ``norm_before_residual``)
  logits:   pre-norm [N, H] -> norm -> lm_head -> [N, V_d]; ``target_logits`` scatters them onto the target's
            vocabulary (-inf where the head cannot propose)
From the second draft step on, the head's own pre-norm hidden state is the next step's feature.
The attention runs through a paged ``KVCache`` of one layer and ``AttentionMetadata``, like every model here.
"""
from __future__ import annotations

import torch
from torch import nn

from saguaro.eagle.checkpoint import Eagle3Config, EagleCheckpointError, load_eagle3
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata
from saguaro.models.model_config import ModelConfig
from saguaro.models.rope import RotaryEmbedding
from saguaro.models.transformer import MLP, Attention, CausalLM, RMSNorm, embedding


def layer_config(cfg: Eagle3Config, width: int | None = None) -> ModelConfig:
    """The Llama config of the head's layer (``width``: the attention's input width, 2H)."""
    return ModelConfig(arch="llama", vocab_size=cfg.vocab_size, hidden_size=width or cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_layers=1, num_heads=cfg.num_heads,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                       rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                       max_position_embeddings=cfg.max_position_embeddings)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(layer_config(cfg, 2 * h))  # q/k/v read 2H ...
        self.self_attn.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)  # ... o writes H
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(layer_config(cfg))

    def forward(self, embeds, feature, cos, sin, kv, meta) -> torch.Tensor:
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = residual + self.self_attn(torch.cat([self.input_layernorm(embeds), normed], -1), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_hidden: int, taps: list[int],
                 embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.config = cfg
        self.taps = taps
        self.fc = nn.Linear(len(taps) * target_hidden, cfg.hidden_size, bias=False)
        # without a table of its own the head reads the target's: held in a tuple, so that it is no submodule
        # (``to(dtype)`` and ``state_dict`` leave the target's table alone)
        self.shared_embed = (embed_tokens,) if embed_tokens is not None else None
        if embed_tokens is None:
            self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if
                             cfg.draft_vocab_size == cfg.vocab_size else torch.zeros(cfg.vocab_size, dtype=torch.bool))

    @property
    def draft_ids(self) -> torch.Tensor:
        """[V_d] the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Use the sorted target ids ``target_ids`` [V_d] as the draft vocabulary (fills d2t and t2d)."""
        ids = target_ids.sort().values.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Pre-norm hidden [N, H] for N rows; their k/v land in ``cache`` (one layer)."""
        table = self.shared_embed[0] if self.shared_embed else self.embed_tokens
        embeds = table(input_ids).to(feature.dtype)
        cos, sin = self.rotary(positions, feature.dtype)
        return self.layer(embeds, feature, cos, sin, cache.layer(0), meta)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary [N, V_d]."""
        return self.lm_head(self.norm(prenorm)).float()

    def target_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the target vocabulary [N, V]: -inf for ids outside the draft vocabulary."""
        draft = self.logits(prenorm)
        full = torch.full((draft.shape[0], self.config.vocab_size), float("-inf"), device=draft.device)
        return full.index_copy_(1, self.draft_ids, draft)

def build_head(cfg: Eagle3Config, state: dict[str, torch.Tensor], target_embed: nn.Embedding,
               taps: list[int], dtype: torch.dtype) -> Eagle3Head:
    """The head with ``state`` loaded (normalized names, ``checkpoint.load_eagle3``), for a target whose
    embedding table is ``target_embed``. Checks every shape against the target."""
    target_hidden = cfg.target_hidden_size or cfg.hidden_size
    if target_embed.num_embeddings != cfg.vocab_size:
        raise EagleCheckpointError(f"the head's vocabulary ({cfg.vocab_size}) is not the target's "
                                   f"({target_embed.num_embeddings})")
    shared = "embed_tokens.weight" not in state
    if shared and target_embed.embedding_dim != cfg.hidden_size:
        raise EagleCheckpointError("the head has no embedding table and its width differs from the target's")
    head = Eagle3Head(cfg, target_hidden, taps, target_embed if shared else None)
    state = dict(state)
    if "d2t" not in state:  # a head over the full vocabulary
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise EagleCheckpointError("a reduced draft vocabulary needs the d2t map")
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    state["t2d"][torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True  # d2t is the source of truth
    expected = set(head.state_dict())
    missing, unknown = expected - set(state), set(state) - expected
    if missing or unknown:
        raise EagleCheckpointError(f"EAGLE-3 weights do not match the config: missing {sorted(missing)}, "
                                   f"unexpected {sorted(unknown)}")
    try:
        head.load_state_dict(state)
        head.to(dtype)
    except RuntimeError as e:  # shape mismatches
        raise EagleCheckpointError(f"EAGLE-3 weights do not fit the config: {e}") from e
    return head.eval().requires_grad_(False)


def load_head(path: str, target: CausalLM, device: torch.device | str = "cpu") -> Eagle3Head:
    """The EAGLE-3 head in directory ``path`` (any layout), for ``target``, in the target's dtype."""
    dtype = next(target.parameters()).dtype
    return head_for(path, target.config, target.model.embed_tokens, dtype).to(device)


def head_for(path: str, target_config: ModelConfig, target_embed: nn.Embedding, dtype: torch.dtype) -> Eagle3Head:
    """The EAGLE-3 head in ``path`` for a target described by its config and embedding table (all an SSD
    speculator holds of the target)."""
    cfg, state, _ = load_eagle3(path)
    taps = cfg.taps_for(target_config.num_layers)
    width = cfg.target_hidden_size or cfg.hidden_size
    if width != target_config.hidden_size:
        raise EagleCheckpointError(f"the head reads target features of width {width}, the target's are "
                                   f"{target_config.hidden_size}")
    return build_head(cfg, state, target_embed, taps, dtype)
