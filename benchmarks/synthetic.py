"""Random-weight models of real shapes, and layer-skip drafts, for benchmarks where real weights cannot go.

A pass costs what its shapes cost, whatever the weights hold, so speed is measured on random weights of
the real configurations (``SHAPES``, from the checkpoints' config.json). Acceptance is another matter:
random models with small weights mostly repeat their input, so every draft agrees with them. Two knobs
make a synthetic pair whose acceptance can be set:

* ``residual_scale`` multiplies the output projections (o_proj, down_proj) at initialisation, so every
  layer moves the residual stream as much as the embedding does and later layers change the prediction;
* ``layer_skip_draft(target, L)`` is the target's first L layers with its embedding, final norm and head
  (shared tensors, no copy). Greedy acceptance grows with L; ``tune_layers`` picks the L nearest a goal.

Every report that uses them says so ("random weights of real shapes; synthetic layer-skip draft").
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from saguaro.loading import LoadedModel
from saguaro.loading.tokenizer import numbered_tokenizer
from saguaro.models.config import ModelConfig
from saguaro.models.transformer import CausalLM

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                         num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                         tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=32768,
                         tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-32b": dict(arch="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                        num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                        tie_word_embeddings=False, attention_bias=True),
    "llama-3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), max_position_embeddings=131072),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                         num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072,
                         tie_word_embeddings=True),
    # for smoke tests of the benchmarks on a CPU
    "tiny": dict(arch="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
                 attention_bias=True),
}
# a target and the draft it is benchmarked with, by shape
PAIRS = {"qwen2.5-1.5b": "qwen2.5-0.5b", "llama-3.1-8b": "llama-3.2-1b", "qwen2.5-32b": "qwen2.5-0.5b",
         "tiny": "tiny"}


def random_model(shape: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 residual_scale: float = 1.0) -> LoadedModel:
    """A ``LoadedModel`` of ``shape`` with N(0, 0.02) weights (norms at 1), made directly on ``device``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                scale = residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.normal_(0, 0.02 * scale)
            elif name.endswith("bias"):
                p.zero_()
    model.eval().requires_grad_(False)
    return LoadedModel(f"random-{shape}", cfg, model, numbered_tokenizer(cfg.vocab_size), Path("."), Path("."), True)


def layer_skip_draft(target: LoadedModel, layers: int) -> LoadedModel:
    """The target's first ``layers`` layers, embedding, final norm and head, sharing the target's tensors."""
    if not 1 <= layers <= target.config.num_layers:
        raise ValueError(f"a layer-skip draft keeps 1 to {target.config.num_layers} layers, got {layers}")
    cfg = ModelConfig(**{**target.config.to_dict(), "num_layers": layers})
    draft = CausalLM.__new__(CausalLM)
    nn.Module.__init__(draft)
    draft.config = cfg
    draft.model = nn.Module()
    draft.model.embed_tokens = target.model.model.embed_tokens
    draft.model.layers = nn.ModuleList(target.model.model.layers[:layers])
    draft.model.norm = target.model.model.norm
    draft.rotary = target.model.rotary
    if not cfg.tie_word_embeddings:
        draft.lm_head = target.model.lm_head
    draft.eval()
    return LoadedModel(f"{target.name}-first{layers}", cfg, draft, target.tokenizer, Path("."), Path("."), True)


def prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def weight_bytes(model: CausalLM) -> int:
    """Bytes one decode step streams: every weight, less the embedding table when the head is separate (a step
    reads one embedding row)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total
