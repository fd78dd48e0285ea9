"""Rotary position embeddings, including Llama-3 and linear frequency scaling.

Layout is the HF "rotate half" one; GGUF loaders undo llama.cpp's interleaved permutation
of q/k weights so that every checkpoint meets this single convention.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # on the CPU whatever the default device: on the meta device arange imports torch's compiler stack (2-3 s)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        freqs = inverse_frequencies(head_dim, theta, scaling)
        default = torch.empty(0).device  # a model built on meta (to be loaded) gets its rotary rebuilt anyway
        self.register_buffer("inv_freq", freqs if default.type == "meta" else freqs.to(default), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos/sin: [N, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
