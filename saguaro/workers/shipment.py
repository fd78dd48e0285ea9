"""What a worker process receives of a model: a registry name or path it loads itself, or tensors in a
``SharedFile`` it maps.

The engine ships a draft to the SSD speculator process and a target to the tensor-parallel ranks it starts
the same way: by name when it has one (the worker maps the same cached file), else its state pickled once
into an anonymous in-memory file that the worker inherits by descriptor and maps (``saved``): the pages
stay shared until one side converts them. What the state holds is the sender's to say (``model_state``
for a ``LoadedModel``; a draft kind adds what it needs to rebuild itself, ``saguaro.drafts``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from saguaro.workers.shared_file import SharedFile


@dataclass
class Shipment:
    name: str | None = None  # a registry name or path the worker loads
    file: SharedFile | None = None  # else: the state, written once by ``holding``

    @classmethod
    def by_name(cls, name: str) -> "Shipment":
        return cls(name=name)

    @classmethod
    def holding(cls, state: dict[str, Any]) -> "Shipment":
        """``state`` (tensors and picklable values) written into a new shared file."""
        file = SharedFile()
        with os.fdopen(os.dup(file.fd), "wb") as f:
            torch.save(state, f)
        return cls(file=file)

    def saved(self) -> dict[str, Any]:
        """In the worker: the state ``holding`` wrote."""
        path = self.file.path()
        if path is not None:  # mapped, not copied: the pages stay shared until one side converts them
            return torch.load(path, mmap=True, weights_only=False)
        with os.fdopen(os.dup(self.file.fd), "rb") as f:
            f.seek(0)
            return torch.load(f, weights_only=False)

    def close(self) -> None:
        """The sender's copy of the descriptor (the worker inherited its own, or never started)."""
        if self.file is not None:
            self.file.close()


def model_state(loaded: Any) -> dict[str, Any]:
    """A ``LoadedModel`` as a shipment's state: its name, config, tokenizer and weights."""
    return {"name": loaded.name, "config": loaded.config, "tokenizer": loaded.tokenizer,
            "state": loaded.model.state_dict()}


def model_from(saved: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    """In the worker: the ``LoadedModel`` that ``model_state`` shipped, built on ``device`` / ``dtype``."""
    from saguaro.loading import LoadedModel
    from saguaro.loading.model_builder import build_model
    model = build_model(saved["config"], saved["state"], dtype, device)
    return LoadedModel(saved["name"], saved["config"], model, saved["tokenizer"], Path("."), Path("."), True)
