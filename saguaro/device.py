"""An engine "device": a CPU core set with a thread count, or a CUDA GPU."""
from __future__ import annotations

import copy
import dataclasses
import math
import os

import torch


# read at import, before any engine pins this process: a second engine then sees the same cores as the first
_ALLOWED = tuple(sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))


def usable_cores() -> list[int]:
    """The CPU cores Saguaro pins its processes to, in order: the target takes the first, an SSD speculator the
    next. ``SAGUARO_CORES`` ("2,3") sets them, e.g. for a second engine on the same machine; by default they are the
    cores this process may run on (``taskset``, a container's cpuset), so pinning never leaves that set.
    ``SAGUARO_CORES=none`` pins nothing (``pinning``) and leaves these the cores this process may run on."""
    given = os.environ.get("SAGUARO_CORES", "").strip()
    if given and given != "none":
        try:
            return [int(c) for c in given.split(",")]
        except ValueError:
            raise ValueError(f"SAGUARO_CORES must list core numbers, like 2,3, or be none: got {given!r}") from None
    return list(_ALLOWED)


def pinning() -> bool:
    """Do processes get pinned by default? Not with ``SAGUARO_CORES=none``: several engines sharing a few cores
    (a parallel test run) keep every core busy when the scheduler may move them, and wait on each other when
    each is held to its own."""
    return os.environ.get("SAGUARO_CORES", "").strip() != "none"


def default_target_cores(always: bool = False) -> list[int] | None:
    """The first usable core; None (no pinning) with ``SAGUARO_CORES=none`` unless ``always`` (a probe of cores)."""
    return usable_cores()[:1] if always or pinning() else None


def default_draft_cores(always: bool = False) -> list[int] | None:
    """The core after the target's; the target's own on a single core (the two then share it)."""
    cores = usable_cores()
    return (cores[1:2] or cores[:1]) if always or pinning() else None


def pin_process(cores: list[int] | None, threads: int) -> None:
    """Pin this process to ``cores`` and use ``threads`` intra-op threads."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)


def load_or_place(model, device: str, dtype: torch.dtype, progress: bool = True):
    """A ``LoadedModel`` on ``device``/``dtype`` from a registry name / path (loaded) or a ``LoadedModel``
    (``place``d)."""
    if isinstance(model, str):
        from saguaro.loading import load_model
        return load_model(model, dtype=dtype, device=device, progress=progress)
    return place(model, device, dtype)


def place(loaded, device: str, dtype: torch.dtype):
    """``loaded`` on ``device``/``dtype``: itself if it is there already, else a converted copy.

    Never converts the caller's model in place: the same ``LoadedModel`` may serve as the
    fp32 target and, converted to bf16, as an int8 draft (or be reused by the caller).
    """
    target = torch.device(device)
    if all(p.device == target and p.dtype == dtype for p in loaded.model.parameters()):
        return loaded
    model = copy.deepcopy(loaded.model).to(device=target, dtype=dtype)
    return dataclasses.replace(loaded, model=model)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` without blocking the host: a CUDA copy from pageable memory
    waits for every kernel queued before it, so host data goes through pinned memory, asynchronously
    (the caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def stack_padded(blocks: list[torch.Tensor | None], width: int, columns: int, device: torch.device) -> torch.Tensor:
    """[len(blocks), width, columns] float32 on ``device``: block b ([n_b <= width, columns]; None: none) in row b,
    zeros past it. One stack and one copy when every block is full (a batch's speculations usually are)."""
    if blocks and all(b is not None and len(b) == width for b in blocks):
        return to_device(torch.stack(blocks).float(), device)
    out = torch.zeros(len(blocks), width, columns, device=device)
    for i, block in enumerate(blocks):
        if block is not None and len(block):
            out[i, :len(block)] = to_device(block, device)
    return out


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` that does not block the host when ``src`` is host data bound for a GPU."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def read_together(tensors: list[torch.Tensor]) -> list[list]:
    """The Python values of several tensors in one read from their device (on a GPU one sync, not one per
    tensor): flattened, joined as float64 (exact for token ids and float32 values), read once, split, and
    nested back into each tensor's shape (integers for integer and bool tensors; a 0-d tensor gives a
    one-element list). The tensors must share one device."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        values = flat[start:start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            values = list(map(int, values))
        out.append(_nest(values, tuple(t.shape)))
    return out


def _nest(values: list, shape: tuple[int, ...]) -> list:
    if len(shape) <= 1:
        return values
    step = math.prod(shape[1:])
    rows = [values[i * step:(i + 1) * step] for i in range(shape[0])]  # a [rows, width] table: no recursion
    return rows if len(shape) == 2 else [_nest(row, shape[1:]) for row in rows]
