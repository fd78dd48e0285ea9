"""Stream priorities for SSD on one GPU: the target's round on a stream of the highest priority, the speculator's
build on one of the lowest. When both streams have blocks ready, the GPU's scheduler starts the target's first and
the build fills the SMs it leaves; the verification then waits less behind the build. A block already running is
never preempted, so priorities shorten the target's wait without stopping the build.

Whether a speculator thread uses them is the overlap probe's verdict for the card (``lane_profile.py``; on by
default). ``SAGUARO_STREAM_PRIORITIES=0`` turns them off, ``=1`` on, over the verdict (both sides at the default
priority when off), for ``bench gpu --mode ssd``, which measures both. On the CPU there are no streams and nothing
changes.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

OFF = ("0", "off", "false", "no")


def enabled() -> bool:
    """The setting, read when a link starts (the benchmarks flip it between runs)."""
    return os.environ.get("SAGUARO_STREAM_PRIORITIES", "1").strip().lower() not in OFF


@dataclass(frozen=True)
class LanePriorities:
    """CUDA stream priorities (a lower number runs first)."""
    target: int
    speculator: int


def lane_priorities(device: str | torch.device, on: bool | None = None,
                    priority_range: tuple[int, int] | None = None) -> LanePriorities | None:
    """The two sides' priorities, or None to leave every stream at the default: turned off (``on``, else the
    setting), not a CUDA device, or a device with a single priority level. ``priority_range``: (least, greatest)
    as ``torch.cuda.Stream.priority_range()`` gives it (asked of the device when None)."""
    if not (enabled() if on is None else on) or torch.device(device).type != "cuda":
        return None
    least, greatest = priority_range if priority_range is not None else torch.cuda.Stream.priority_range()
    if least == greatest:
        return None
    return LanePriorities(target=greatest, speculator=least)


class TargetLane:
    """The target's side: ``with lane():`` runs a round on a stream of the target's priority, ordered after the
    thread's current stream at entry and before it again at exit (so the rest of the engine, and the caching
    allocator, see the round's work as the current stream's). Without priorities it does nothing."""

    def __init__(self, device: str | torch.device, priorities: LanePriorities | None):
        self.priorities = priorities
        self.stream = None if priorities is None else torch.cuda.Stream(torch.device(device),
                                                                        priority=priorities.target)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)


def no_lane() -> TargetLane:
    """A link without a lane of its own (a process, two GPUs, the CPU): rounds run where they are."""
    return TargetLane("cpu", None)
