"""A point-to-point message channel between verifier and speculator over torch.distributed.

Gloo on CPU, NCCL on CUDA. Built on its own ``TCPStore`` and process group object rather
than the global default group, so several engines can live in one process (tests) and
nothing leaks between them. A message is a short list of flat tensors (at most
``MAX_FRAMES``); their dtypes and lengths travel first in one fixed-size header frame, so the
receiver can size its buffers.
"""
from __future__ import annotations

import mmap
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from saguaro.workers.shared_file import SharedFile

_DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.float16]  # codes on the wire: append only
MAX_FRAMES = 4
_HEADER = 1 + 2 * MAX_FRAMES  # [frame count, (dtype code, length) per frame]


class ChannelClosed(RuntimeError):
    """The peer died, closed the connection, or did not answer in time."""


class Channel:
    """One end of the link. ``counters`` (``MessageCounters``) count the messages each rank has sent;
    they let a busy receiver check for a waiting message without blocking, which gloo's receive
    handles do not offer."""

    def __init__(self, rank: int, port: int, counters: "MessageCounters", backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 60.0):
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.counters = counters
        self.received = 0
        self.store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=timeout_s))
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, 2, timedelta(seconds=timeout_s))
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, 2, dist.ProcessGroupNCCL.Options())
        else:
            raise ValueError(f"unknown backend {backend!r}")

    def send(self, message: torch.Tensor | list[torch.Tensor]) -> None:
        frames = [message] if isinstance(message, torch.Tensor) else list(message)
        if not 1 <= len(frames) <= MAX_FRAMES:
            raise ValueError(f"a message holds 1 to {MAX_FRAMES} tensors, got {len(frames)}")
        header = [len(frames)] + [0] * (2 * MAX_FRAMES)
        for i, f in enumerate(frames):
            header[1 + 2 * i:3 + 2 * i] = [_DTYPES.index(f.dtype), f.numel()]
        self.counters.bump(self.rank)
        try:
            self.pg.send([torch.tensor(header, dtype=torch.int64, device=self.device)], self.peer, 0).wait()
            for i, f in enumerate(frames):
                if f.numel():
                    self.pg.send([f.to(self.device).contiguous().reshape(-1)], self.peer, 1 + i).wait()
        except RuntimeError as e:
            raise ChannelClosed(f"send failed: {e}") from e

    def poll(self) -> bool:
        """Is a message from the peer waiting?"""
        return self.counters.count(self.peer) > self.received

    def recv(self, timeout_s: float | None = None, alive=lambda: True) -> list[torch.Tensor]:
        """Wait for the next message (its tensors, on the CPU); raise ``ChannelClosed`` on timeout or if
        ``alive()`` turns false."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                raise ChannelClosed(f"no message within {timeout_s:.1f} s")
            if not alive():
                raise ChannelClosed("peer process is gone")
            time.sleep(0.0002)
        self.received += 1
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        frames = []
        try:
            self.pg.recv([header], self.peer, 0).wait()
            count, *sizes = header.tolist()
            for i in range(count):
                code, numel = sizes[2 * i:2 * i + 2]
                buf = torch.empty(numel, dtype=_DTYPES[code], device=self.device)
                if numel:
                    self.pg.recv([buf], self.peer, 1 + i).wait()
                frames.append(buf.cpu())
        except RuntimeError as e:
            raise ChannelClosed(f"receive failed: {e}") from e
        return frames

    def close(self) -> None:
        self.pg = None
        self.store = None


class MessageCounters:
    """Messages sent by rank 0 and by rank 1, as two int64s in memory both processes map.

    Each count has a single writer (its rank) and only grows, so no lock is needed: an aligned
    8-byte store is read whole, and a reader that sees a count late only polls once more.
    It travels to the worker as a ``SharedFile`` descriptor and is mapped again there.
    """

    def __init__(self, file: SharedFile | None = None):
        self.file = file or SharedFile(16)
        self._map = mmap.mmap(self.file.fd, 16)
        self._counts = memoryview(self._map).cast("q")

    def bump(self, rank: int) -> None:
        self._counts[rank] += 1

    def count(self, rank: int) -> int:
        return self._counts[rank]

    def __getstate__(self) -> dict:
        return {"file": self.file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["file"])
