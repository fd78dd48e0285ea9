"""An engine "device": a CPU core set with a thread count, or a CUDA GPU."""
from __future__ import annotations

import os

import torch


def pin_process(cores: list[int] | None, threads: int) -> None:
    """Pin this process to ``cores`` and use ``threads`` intra-op threads."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)


def describe(device: str, cores: list[int] | None, threads: int) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    where = f"cores {cores}" if cores else "all cores"
    return f"cpu, {where}, {threads} thread(s)"


def place(loaded, device: str, dtype: torch.dtype):
    """Move a ``LoadedModel``'s weights to ``device``/``dtype`` (in place) and return it."""
    loaded.model.to(device=torch.device(device), dtype=dtype)
    return loaded
