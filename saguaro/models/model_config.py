"""Architecture description shared by every model family we run.

One dataclass covers Llama, Qwen2 and Qwen3: they differ only in a few switches
(q/k/v bias, q/k RMSNorm, RoPE scaling, tied head). Loaders for HF directories and
GGUF files both produce a ``ModelConfig``; the model never looks at raw metadata.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers ``config.json`` dict."""
        model_type = hf.get("model_type", "llama")
        arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_theta, rope_scaling = rope_settings(hf)
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of a transformers config dict: ``rope_theta`` and ``rope_scaling``, or transformers 5's
    ``rope_parameters`` that nests both; scaling None for plain RoPE (``rope_type`` "default" or absent)."""
    scaling, theta = hf.get("rope_scaling"), hf.get("rope_theta")
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return (theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)
