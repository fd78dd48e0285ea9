"""Random-weight models of real shapes, and synthetic target/draft pairs, for benchmarks where real weights
cannot go.

A pass costs what its shapes cost, whatever the weights hold, so speed is measured on random weights of
the real configurations (``SHAPES``, from the checkpoints' config.json). Acceptance is another matter: a
plain random target emits one constant token, and a layer-skip draft of it agrees about never or always.
``synthetic_pair`` plants a language in random weights of the real shapes, so that greedy acceptance,
its decay by draft position and SSD's cache hits resemble a real pair's:

* the pair speaks a vocabulary subset S: embedding rows outside S are scaled down, so with the head tied
  (by value where the checkpoint has its own head) no token outside S is ever the argmax;
* layer 0's MLP is a lookup table, one unit per token t of S: its gate and up rows lie along t's
  normalised embedding, so the unit fires for t alone, and its down column writes
  E[next(t)] + c_t sum_j E[rival_j(t)] - E[t] into the residual stream. ``next`` is a random
  permutation of S (long cycles: the text does not repeat); the rivals are random members of S that all
  trail next(t) by one margin 1 - c_t, drawn per token from ``margin`` (small: a hard token);
* layers 1..N-1 stay random, their output projections scaled so that together they move a logit margin
  by about ``noise`` (a standard deviation, context-dependent through attention). Where that overturns a
  small margin the target emits a rival instead of next(t);
* the draft is the target's first L layers with the shared embedding, norm and head (no copy): it
  misses most of the later layers' push, so it disagrees where the target's rival won. The rivals tie in
  the draft but for its own smaller push, so its runner-up is the target's choice only part of the time:
  SSD's cache hits on rejections come out partial, as with real pairs.

``residual_scale`` (``random_model``) is the bare knob beneath ``noise``. Every report that uses these says
so ("random weights of real shapes; synthetic layer-skip draft"). ``python -m benchmarks.synthetic --tune``
measures acceptance for a few (noise, L).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from saguaro.loading import LoadedModel
from saguaro.loading.model_builder import build_model
from saguaro.loading.tokenizer import numbered_tokenizer
from saguaro.models.model_config import ModelConfig
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
    """A ``LoadedModel`` of ``shape`` with N(0, 0.02) weights (norms at 1, biases 0), made directly on ``device``
    in ``dtype``: nothing passes through float32 (a 32B model in bf16 fills most of one 80 GB GPU)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape])
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in CausalLM(cfg).state_dict().items()}
    torch.manual_seed(seed)
    state = {}
    for name, size in shapes.items():
        w = torch.empty(size, dtype=dtype, device=device)
        if len(size) > 1:
            w.normal_(0, 0.02 * (residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0))
        else:
            w.fill_(0.0 if name.endswith("bias") else 1.0)  # norms at 1
        state[name] = w
    model = build_model(cfg, state, dtype, device)
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


@dataclass(frozen=True)
class PairRecipe:
    """How ``synthetic_pair`` builds a pair (module docstring); every field lands in the pair's ``info``."""
    draft_layers: int  # L: the draft is the target's first L layers
    noise: float  # std of the later layers' push on a logit margin (margins are in units of one embedding's |E|^2)
    margin: tuple[float, float] = (0.05, 0.5)  # t's rivals trail next(t) by a margin drawn uniformly from this
    rivals: int = 2  # runner-up tokens per token of S, tied in the lookup
    subset: int = 4096  # |S|, at most the MLP width
    outside: float = 0.1  # scale of the embedding rows outside S
    gain: float = 10.0  # a lookup unit's gate on its own token (SiLU(gain) ~ gain; ~0 on others)
    seed: int = 0


# tuned with ``python -m benchmarks.synthetic --tune`` (greedy acceptance ~0.8 at K=4); L keeps the draft's
# bytes per step near the real draft's (a third of the target's for Qwen2.5 1.5B / 0.5B)
DEFAULT_RECIPES = {
    "qwen2.5-1.5b": PairRecipe(draft_layers=6, noise=0.19),
    "llama-3.1-8b": PairRecipe(draft_layers=6, noise=0.19),
    "qwen2.5-32b": PairRecipe(draft_layers=2, noise=0.19),
    "tiny": PairRecipe(draft_layers=2, noise=0.19, subset=256),
}


def residual_scale_for(cfg: ModelConfig, noise: float) -> float:
    """The ``residual_scale`` at which layers 1..N-1 of a ``random_model`` push a logit margin by ``noise``.

    A layer sees an RMS-normalised input, so its q/k/v, gate and up outputs have std s = 0.02 sqrt(hidden):
    per coordinate, its MLP adds 0.02 sqrt(intermediate) rms(SiLU(s z)) s and its attention 0.02
    sqrt(heads * head_dim) s (as if each query attended to one position; it averages over several). N-1
    layers add up in quadrature, and a margin between two tokens of S moves by that over |E| = 0.02
    sqrt(hidden), times sqrt(2). Only roughly: ``noise`` is a knob that carries across shapes, not a figure."""
    sigma = 0.02 * math.sqrt(cfg.hidden_size)
    z = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    pdf = torch.exp(-z * z / 2)
    silu_rms = math.sqrt(float((pdf * F.silu(sigma * z) ** 2).sum() / pdf.sum()))
    mlp = 0.02 * math.sqrt(cfg.intermediate_size) * silu_rms * sigma
    attention = 0.02 * math.sqrt(cfg.num_heads * cfg.head_dim) * sigma
    push = math.hypot(mlp, attention) * math.sqrt(max(cfg.num_layers - 1, 1)) * math.sqrt(2) / sigma
    return noise / push


@torch.no_grad()
def plant_language(model: CausalLM, recipe: PairRecipe) -> dict[str, torch.Tensor]:
    """Make ``model`` (a ``random_model``) speak S: the embedding outside S shrunk, the head tied by value,
    layer 0 a lookup table t -> next(t) with rivals. Returns S, next and the rivals as id tensors."""
    cfg, layers = model.config, model.model.layers
    size = min(recipe.subset, cfg.intermediate_size, cfg.vocab_size)
    if size < recipe.rivals + 2:
        raise ValueError(f"a vocabulary subset of {size} tokens cannot hold a token, its next and "
                         f"{recipe.rivals} rivals")
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    subset = torch.randperm(cfg.vocab_size, generator=gen)[:size]
    order = torch.randperm(size, generator=gen)
    nxt = subset[order]  # next(S[i]) = nxt[i]: a random permutation, so its cycles are long
    rivals = subset[torch.randint(0, size, (size, recipe.rivals), generator=gen)]  # (a rare repeat is harmless)
    lo, hi = recipe.margin
    weights = 1 - (lo + (hi - lo) * torch.rand(size, 1, generator=gen)).expand(size, recipe.rivals)  # c = 1 - margin
    device = model.model.embed_tokens.weight.device
    subset, nxt, rivals, weights = subset.to(device), nxt.to(device), rivals.to(device), weights.to(device)

    emb = model.model.embed_tokens.weight
    outside = torch.ones(cfg.vocab_size, dtype=torch.bool, device=device)
    outside[subset] = False
    emb[outside] *= recipe.outside
    if not cfg.tie_word_embeddings:
        model.lm_head.weight.copy_(emb)

    first = layers[0]
    first.self_attn.o_proj.weight.zero_()  # layer 0 is the lookup alone: its MLP sees E[t] exactly
    e = emb[subset].float()
    unit = e / e.pow(2).mean(-1, keepdim=True).sqrt()  # what the MLP sees (its norm's weight is 1)
    written = emb[nxt].float() + (weights[..., None] * emb[rivals].float()).sum(1) - e
    mlp, dtype, hidden = first.mlp, emb.dtype, cfg.hidden_size
    for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
        w.zero_()
    mlp.gate_proj.weight[:size] = (recipe.gain * unit / hidden).to(dtype)  # = gain on t, ~N(0, gain^2/d) else
    mlp.up_proj.weight[:size] = (unit / hidden).to(dtype)  # = 1 on t
    mlp.down_proj.weight[:, :size] = (written / F.silu(torch.tensor(recipe.gain))).T.to(dtype)
    return {"subset": subset, "next": nxt, "rivals": rivals}


def synthetic_pair(target_shape: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                   **overrides: Any) -> tuple[LoadedModel, LoadedModel, dict[str, Any]]:
    """A target of ``target_shape`` speaking a planted language and its layer-skip draft, with ``info``: the
    recipe (``DEFAULT_RECIPES`` for the shape, fields overridden by keyword), the residual scale it gave,
    the draft's share of the target's bytes per step, and the language (``subset``, ``next``, ``rivals``)."""
    if target_shape not in SHAPES:
        raise ValueError(f"unknown shape {target_shape!r}; known: {', '.join(SHAPES)}")
    base = DEFAULT_RECIPES.get(target_shape, DEFAULT_RECIPES["qwen2.5-1.5b"])
    recipe = dataclasses.replace(base, **overrides)
    cfg = ModelConfig(**SHAPES[target_shape])
    scale = residual_scale_for(cfg, recipe.noise)
    target = random_model(target_shape, device, dtype, recipe.seed, residual_scale=scale)
    language = plant_language(target.model, recipe)
    draft = layer_skip_draft(target, recipe.draft_layers)
    info = {"shape": target_shape, **dataclasses.asdict(recipe), "residual_scale": scale,
            "draft_bytes_share": weight_bytes(draft.model) / weight_bytes(target.model), **language}
    return target, draft, info


if __name__ == "__main__":
    from benchmarks.synthetic_tune import main  # the tuner builds on this module
    main()
