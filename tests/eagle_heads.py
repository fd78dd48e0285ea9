"""Random EAGLE-3 heads for tiny targets, written in each public layout (not a test file)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from saguaro.eagle.checkpoint import Eagle3Config, save_eagle3
from saguaro.eagle.head import Eagle3Head


def random_head_state(target, draft_vocab: int | None = None, seed: int = 0, own_embed: bool = False,
                      scale: float = 0.3) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """A random head for ``target`` (a tiny ``LoadedModel``) under normalized names."""
    tc = target.config
    cfg = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_heads=4, num_kv_heads=2,
                       head_dim=tc.hidden_size // 4, vocab_size=tc.vocab_size,
                       draft_vocab_size=draft_vocab or tc.vocab_size, max_position_embeddings=512)
    torch.manual_seed(seed)
    taps = cfg.taps_for(tc.num_layers)
    head = Eagle3Head(cfg, tc.hidden_size, taps, None if own_embed else target.model.model.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, scale)
        if draft_vocab:
            head.set_vocabulary(torch.randperm(tc.vocab_size)[:draft_vocab])
    return cfg, dict(head.state_dict())


def write_head(directory: Path, cfg: Eagle3Config, state: dict[str, torch.Tensor], layout: str) -> Path:
    """Write the head in ``layout``: "midlayer" (the EAGLE authors'), "hf" (model.layers.0.*) or
    "speculators" (config with speculators_config, weights under layers.0.*)."""
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "midlayer":
        save_eagle3(directory, cfg, state)
        return directory
    prefix = "model.layers.0." if layout == "hf" else "layers.0."
    out = {}
    for name, t in state.items():
        if name.startswith("layer."):
            out[prefix + name[len("layer."):]] = t
        elif layout == "hf" and name in ("norm.weight", "embed_tokens.weight"):
            out["model." + name] = t
        else:
            out[name] = t
    layer = {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
             "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings}
    if layout == "hf":
        raw = {"architectures": ["Eagle3LlamaForCausalLM"], **layer, "draft_vocab_size": cfg.draft_vocab_size}
    else:
        raw = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
               "norm_before_residual": cfg.norm_before_residual,
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
    (directory / "config.json").write_text(json.dumps(raw))
    save_file({n: t.contiguous() for n, t in out.items()}, str(directory / "model.safetensors"))
    return directory


def random_head_dir(target, tmp_path_factory, layout: str, **head) -> str:
    """A random head for ``target`` (``random_head_state``'s keywords) written in ``layout`` to a new directory."""
    cfg, state = random_head_state(target, **head)
    return str(write_head(tmp_path_factory.mktemp("eagle"), cfg, state, layout))
