"""The CPU cores Saguaro pins its processes to: which are usable, the defaults for the target and an SSD
speculator, and pinning a process (with its torch thread count)."""
from __future__ import annotations

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
