"""Load a transformers-style model directory (config.json + safetensors + tokenizer.json).

Also used for our own converted caches, which use the same file names but store a
``ModelConfig`` dict (it has an ``arch`` key instead of ``model_type``).
Weights are opened memory-mapped; shards listed in ``model.safetensors.index.json``
are merged into one name→tensor mapping.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from saguaro.loading.tokenizer import Tokenizer
from saguaro.models.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


class ModelDirectoryError(ValueError):
    """A directory that lacks, or has unreadable, files a model needs."""


@dataclass
class DirectoryContents:
    config: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelDirectoryError(f"cannot read {path}: {e}") from e


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelDirectoryError(f"{directory} has no config.json; expected an HF model directory")
    raw = _read_json(path)
    if "arch" in raw and "model_type" not in raw:
        return ModelConfig.from_dict(raw)
    config = ModelConfig.from_hf(raw)
    # instruct models often list extra end-of-turn ids only in generation_config.json
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = _read_json(gen).get("eos_token_id")
        for i in [eos] if isinstance(eos, int) else (eos or []):
            if i not in config.eos_token_ids:
                config.eos_token_ids.append(int(i))
    return config


def weight_files(directory: Path, file_name: str = WEIGHTS_FILE) -> list[Path]:
    """The safetensors file(s) holding the weights, in shard order."""
    single = directory / file_name
    if single.is_file():
        return [single]
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise ModelDirectoryError(f"{directory}: shards listed in {INDEX_FILE} are missing: {missing}")
        return [directory / s for s in shards]
    raise ModelDirectoryError(f"{directory} has neither {file_name} nor {INDEX_FILE} "
                              "(only safetensors weights are supported)")


def read_weights(directory: Path, file_name: str = WEIGHTS_FILE) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory, file_name):
        try:
            state.update(load_file(str(path)))  # memory-mapped, lazy
        except Exception as e:  # safetensors raises its own error type on damage
            raise ModelDirectoryError(f"cannot read weights {path} (truncated or corrupt?): {e}") from e
    return state


def read_chat_template(directory: Path) -> str | None:
    """``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template`` (newer HF layout)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        template = _read_json(tc).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template
    return None


def _special_id(tokenizer: Tokenizer, value: Any) -> int | None:
    if isinstance(value, dict):  # AddedToken serialisation
        value = value.get("content")
    return tokenizer.token_to_id(value) if isinstance(value, str) else None


def read_tokenizer(directory: Path, config: ModelConfig) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelDirectoryError(f"{directory} has no tokenizer.json (a fast tokenizer file is required)")
    tok = Tokenizer.from_file(path, chat_template=read_chat_template(directory))
    eos_ids = list(config.eos_token_ids)
    bos_id = config.bos_token_id
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        raw = _read_json(tc)
        eos = _special_id(tok, raw.get("eos_token"))
        if eos is not None and eos not in eos_ids:
            eos_ids.insert(0, eos)  # the tokenizer's eos is what its chat template ends turns with
        bos = _special_id(tok, raw.get("bos_token"))
        bos_id = bos if bos is not None else bos_id
    tok.eos_token_ids, tok.bos_token_id = eos_ids, bos_id
    return tok


def read_directory(directory: Path | str, weights_file: str = WEIGHTS_FILE) -> DirectoryContents:
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelDirectoryError(f"not a directory: {directory}")
    config = read_config(directory)
    return DirectoryContents(config, read_weights(directory, weights_file), read_tokenizer(directory, config))
