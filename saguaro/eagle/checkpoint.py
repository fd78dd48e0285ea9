"""EAGLE-3 head checkpoints: an HF directory (config.json + safetensors or pytorch_model.bin) in any of three
public layouts.

Glossary:
  H_t        the target's hidden size; the head reads ``len(taps)`` of its hidden states (fc: 3*H_t -> H)
  H          the head's hidden size (usually H_t)
  draft vocab the head's reduced output vocabulary of ``draft_vocab_size`` ids; draft id i is target id
             ``i + d2t[i]``; ``t2d`` marks the target ids the head can propose
  taps       the target layers whose input residual stream the head reads (the paper: [2, L/2, L-3]), in
             ascending order: the order every engine concatenates them in (it collects them during the forward)

Layouts (weight names are normalized to the first):
  ``midlayer.*``        the EAGLE authors' releases: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``
  ``model.layers.0.*``  HF-style names under ``model.`` (``model.fc``, ``model.norm``, ``model.embed_tokens``)
  ``speculators``       config.json has ``speculators_config`` and nests the layer's config in
                        ``transformer_layer_config``; weights under ``layers.0.*``
The embedding table is optional: without one the head shares the target's.
A saved head's config.json is a one-layer Llama config (``num_hidden_layers: 1``, ``hidden_act``, the RoPE
settings), so transformers' ``AutoConfig``, vLLM and SGLang read it as the one layer it is.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from saguaro.models.model_config import rope_settings

LAYOUTS = ("midlayer", "hf", "speculators")


class EagleCheckpointError(ValueError):
    """A directory that is not a readable EAGLE-3 head."""


@dataclass
class Eagle3Config:
    hidden_size: int  # H
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # as a target's: None, "linear" or "llama3" (models/rope.py)
    hidden_act: str = "silu"  # the MLP's activation (the only one an EAGLE-3 head uses)
    max_position_embeddings: int = 4096
    target_hidden_size: int | None = None  # H_t (None: H)
    taps: list[int] | None = None  # None: the paper's [2, L/2, L-3] for the target it runs with
    norm_before_residual: bool = False  # speculators: the residual is hidden_norm(feature), not the feature

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "draft_vocab_size"):
            if getattr(self, name) <= 0:
                raise EagleCheckpointError(f"EAGLE-3 config: {name} must be positive, got {getattr(self, name)}")
        if self.draft_vocab_size > self.vocab_size:
            raise EagleCheckpointError(f"draft vocabulary ({self.draft_vocab_size}) exceeds the target's "
                                       f"({self.vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise EagleCheckpointError("EAGLE-3 config: num_heads must be a multiple of num_kv_heads")
        if self.hidden_act != "silu":
            raise EagleCheckpointError(f"EAGLE-3 config: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.taps is not None:
            self.taps = sorted(self.taps)

    def taps_for(self, num_target_layers: int) -> list[int]:
        """The taps for a target of ``num_target_layers`` layers: the checkpoint's, checked to exist, or
        the paper's [2, L/2, L-3] (clamped into the target, for tiny test models)."""
        if self.taps is None:
            return default_taps(num_target_layers)
        bad = [i for i in self.taps if not 0 <= i < num_target_layers]
        if bad:
            raise EagleCheckpointError(f"taps {bad} do not exist in a {num_target_layers}-layer target")
        return list(self.taps)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Eagle3Config":
        layer = raw.get("transformer_layer_config", raw)  # speculators nests the layer's config
        heads = layer["num_attention_heads"]
        vocab = layer.get("vocab_size", raw.get("vocab_size"))
        theta, scaling = rope_settings(layer)
        try:
            return cls(
                hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"], num_heads=heads,
                num_kv_heads=layer.get("num_key_value_heads") or heads,
                head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, vocab_size=vocab,
                draft_vocab_size=raw.get("draft_vocab_size", layer.get("draft_vocab_size", vocab)),
                rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                hidden_act=layer.get("hidden_act", "silu"),
                max_position_embeddings=layer.get("max_position_embeddings", 4096),
                target_hidden_size=raw.get("target_hidden_size", layer.get("target_hidden_size")),
                taps=raw.get("eagle_aux_hidden_state_layer_ids",
                             raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")),
                norm_before_residual=bool(raw.get("norm_before_residual", False)))
        except (KeyError, TypeError) as e:
            raise EagleCheckpointError(f"EAGLE-3 config.json lacks a field: {e}") from e


def default_taps(num_layers: int) -> list[int]:
    """The paper's [2, L/2, L-3], clamped into a target of ``num_layers`` layers (tiny test models)."""
    return sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def is_eagle3_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory whose config.json describes an EAGLE-3 head."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    archs = " ".join(raw.get("architectures") or []).lower()
    return ("eagle" in archs or "speculators_config" in raw or raw.get("speculators_model_type") == "eagle3"
            or "draft_vocab_size" in raw)


def _normalize(name: str) -> str:
    """One spelling for every layout: ``fc``, ``embed_tokens``, ``layer.*``, ``norm``, ``lm_head``, ``d2t``..."""
    if name.startswith("model."):
        name = name[len("model."):]
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    return name


def _read_config(directory: Path) -> dict[str, Any]:
    if not (directory / "config.json").is_file():
        raise EagleCheckpointError(f"{directory} has no config.json; expected an EAGLE-3 head directory")
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EagleCheckpointError(f"cannot read {directory / 'config.json'}: {e}") from e


def load_eagle3_config(path: str | Path) -> Eagle3Config:
    """The config of the head in directory ``path``, without its weights (e.g. the layers a target taps for it)."""
    return Eagle3Config.from_json(_read_config(Path(path)))


def load_eagle3(path: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor], str]:
    """(config, weights under normalized names, layout) of the head in directory ``path``."""
    directory = Path(path)
    raw = _read_config(directory)
    state = _read_weights(directory)
    names = list(state)
    if "speculators_config" in raw or "transformer_layer_config" in raw:
        layout = "speculators"
    elif any(n.startswith("midlayer.") for n in names):
        layout = "midlayer"
    elif any(n.startswith(("model.layers.0.", "layers.0.")) for n in names):
        layout = "hf"
    else:
        raise EagleCheckpointError(f"{directory}: no decoder layer weights (midlayer.*, model.layers.0.* or "
                                   "layers.0.*)")
    return Eagle3Config.from_json(raw), {_normalize(n): t for n, t in state.items()}, layout


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head: its ``*.safetensors`` files, else its ``pytorch_model*.bin`` (the EAGLE
    authors' releases), read as plain tensors (``weights_only``: a pickle may run no code)."""
    state: dict[str, torch.Tensor] = {}
    files = sorted(directory.glob("*.safetensors"))
    for f in files:
        state.update(load_file(str(f)))
    if not files:
        files = sorted(directory.glob("pytorch_model*.bin"))
        for f in files:
            try:
                loaded = torch.load(f, map_location="cpu", weights_only=True)
            except (RuntimeError, pickle.UnpicklingError, EOFError) as e:  # not a zip, or a pickle of objects
                raise EagleCheckpointError(f"cannot read {f} as a weights-only state dict: {e}") from e
            if not isinstance(loaded, dict):
                raise EagleCheckpointError(f"{f} holds a {type(loaded).__name__}, not a state dict")
            state.update(loaded)
    if not files:
        raise EagleCheckpointError(f"{directory} has no weights (*.safetensors or pytorch_model.bin)")
    return state


def save_eagle3(path: str | Path, config: Eagle3Config, state: dict[str, torch.Tensor]) -> None:
    """Write a head in the EAGLE authors' layout (``midlayer.*``), which every loader of the format reads."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    fields = asdict(config)
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "num_attention_heads": fields.pop("num_heads"), "num_key_value_heads": fields.pop("num_kv_heads"),
           "eagle_aux_hidden_state_layer_ids": fields.pop("taps"), **fields}
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    out = {("midlayer." + n[len("layer."):] if n.startswith("layer.") else n): t.detach().contiguous().cpu()
           for n, t in state.items()}
    save_file(out, str(directory / "model.safetensors"))
