"""Turn (ModelConfig, state dict) into a ready CausalLM without a wasted initialisation.

Constructing ``CausalLM(cfg)`` normally allocates and randomly initialises every weight
(seconds for 1.5B parameters) only to overwrite them. We build on the ``meta`` device
and *assign* the loaded tensors instead; memory-mapped safetensors in the right dtype are
then used in place, with no copy at all. Non-persistent buffers (RoPE frequencies) are
not in checkpoints, so the rotary module is rebuilt on the real device afterwards.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from saguaro.models.model_config import ModelConfig
from saguaro.models.rope import RotaryEmbedding
from saguaro.models.transformer import CausalLM

# checkpoint entries that carry no weights of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not fit the model its config describes."""


def build_model(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", make: Callable[[ModelConfig], CausalLM] = CausalLM) -> CausalLM:
    """A CausalLM in eval mode with frozen parameters, holding ``state`` cast to ``dtype`` on ``device``.

    ``make`` builds the empty model (a tensor-parallel shard passes its own, whose shapes ``state`` fits)."""
    with torch.device("meta"):
        model = make(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    weights: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in state.items():
        if name in expected:
            weights[name] = tensor
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still store the (identical) head
        elif not name.endswith(_IGNORED_SUFFIXES):
            unexpected.append(name)
    missing = sorted(set(expected) - set(weights))
    if missing or unexpected:
        raise WeightMismatchError(
            f"checkpoint does not match the {config.arch} config: "
            f"missing {missing[:5]}{' …' if len(missing) > 5 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:5]}{' …' if len(unexpected) > 5 else ''} ({len(unexpected)})")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise WeightMismatchError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                      f"model expects {tuple(expected[name])}")
        weights[name] = tensor.to(device=device, dtype=dtype)  # no-op (no copy) when already matching
    model.load_state_dict(weights, assign=True, strict=True)
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    model.eval()
    model.requires_grad_(False)
    return model
