"""What ``dtype="auto"`` means: the dtype a checkpoint was published in.

  * a registered model: its spec's ``dtype`` (the Qwen2.5-Coder and SmolLM2 releases are bf16; the
    GGUF files we ship quantize those bf16 weights);
  * an HF directory: ``config.json``'s ``dtype`` (transformers 5) or ``torch_dtype`` (4), else the
    dtype of the first tensor in its safetensors file;
  * a GGUF file: F32 -> float32, F16 -> float16, BF16 or any quantization -> bfloat16 (quants are
    made from 16-bit releases, and bf16 holds every dequantized value's range);
  * a converted cache directory: the registered model or the GGUF it was converted from;
  * a model already in memory (``LoadedModel``): the dtype of its parameters.

A source this cannot read gives "float32"; the load that follows reports what is wrong with it.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from saguaro.loading import converted_cache
from saguaro.loading.registry import MODELS

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}  # general.file_type: ALL_F32, MOSTLY_F16, MOSTLY_BF16


def checkpoint_dtype(model: Any) -> str:
    """The published dtype of a registry name, a path, or a ``LoadedModel`` (see the module docstring)."""
    if hasattr(model, "model") and hasattr(model.model, "parameters"):
        first = next(model.model.parameters(), None)
        return _NAMES.get(first.dtype, "float32") if first is not None else "float32"
    text = str(model)
    path = Path(text).expanduser()
    if not path.exists():
        spec = MODELS.get(text.lower())
        return spec.dtype if spec is not None else "float32"
    try:
        if path.is_dir():
            return _directory_dtype(path)
        return _gguf_dtype(path)
    except (OSError, ValueError, KeyError, struct.error):
        return "float32"


def _directory_dtype(path: Path) -> str:
    if converted_cache.is_converted_dir(path):
        info = converted_cache.source_info(path) or {}
        spec = next((s for s in MODELS.values() if s.sha256 == info.get("sha256")), None)
        if spec is not None:
            return spec.dtype
        source = Path(info.get("source", ""))
        return _gguf_dtype(source) if source.is_file() else "bfloat16"
    config = json.loads((path / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and named.removeprefix("torch.") in ("float32", "bfloat16", "float16"):
        return named.removeprefix("torch.")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return "float32"
    with open(files[0], "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    kinds = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
    return _SAFETENSORS.get(kinds[0], "float32") if kinds else "float32"


def _gguf_dtype(path: Path) -> str:
    from gguf import GGUFReader
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return "float32"
    field = GGUFReader(path, "r").fields.get("general.file_type")
    file_type = int(field.contents()) if field is not None else None
    return _GGUF_FILE_TYPES.get(file_type, "bfloat16")
