"""A model on the device and dtype the engine runs it at: loaded from a name or path, or placed from memory."""
from __future__ import annotations

import copy
import dataclasses

import torch

from saguaro.loading import LoadedModel, load_model


def load_or_place(model: str | LoadedModel, device: str, dtype: torch.dtype, progress: bool = True) -> LoadedModel:
    """A ``LoadedModel`` on ``device``/``dtype`` from a registry name / path (loaded) or a ``LoadedModel``
    (``place``d)."""
    if isinstance(model, str):
        return load_model(model, dtype=dtype, device=device, progress=progress)
    return place(model, device, dtype)


def place(loaded: LoadedModel, device: str, dtype: torch.dtype) -> LoadedModel:
    """``loaded`` on ``device``/``dtype``: itself if it is there already, else a converted copy.

    Never converts the caller's model in place: the same ``LoadedModel`` may serve as the
    fp32 target and, converted to bf16, as an int8 draft (or be reused by the caller).
    """
    target = torch.device(device)
    if all(p.device == target and p.dtype == dtype for p in loaded.model.parameters()):
        return loaded
    model = copy.deepcopy(loaded.model).to(device=target, dtype=dtype)
    return dataclasses.replace(loaded, model=model)
