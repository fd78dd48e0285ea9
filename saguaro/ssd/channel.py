"""A point-to-point message channel between verifier and speculator over torch.distributed.

Built on its own ``TCPStore`` and process groups rather than the global default group, so several engines can
live in one process (tests) and nothing leaks between them. A message is a short list of flat tensors (at most
``MAX_FRAMES``), each sent where it lives:

  * host frames (the int64 fields a side's scheduler reads: flags, token ids, counts) cross a Gloo group;
  * device frames (distributions, an EAGLE-3 target's features), on the NCCL link only, cross an NCCL group from
    the sender's GPU straight into a buffer on the receiver's: never through host memory. On the Gloo link
    (a CPU speculator) every frame is a host frame.

Every message starts with one fixed-size header (``HEADER_WORDS`` int64, on the host): the frame count, each
frame's dtype, length and place, and then, inline, the bytes of every host frame that fits (a round's fields
usually do). The receiver reads the header's directory once -- the only host read of a message -- and takes the
inline frames as views of the header; so a greedy round is one Gloo message each way, and a sampled round on
the NCCL link adds one device transfer that the host never waits for (the receiving stream does).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from saguaro.workers.shared_file import SharedFile

_DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.float16]  # codes on the wire: append only
MAX_FRAMES = 4
INLINE, HOST, DEVICE = 0, 1, 2  # a frame's place: in the header, a Gloo frame of its own, an NCCL frame
_DIRECTORY = 1 + 3 * MAX_FRAMES  # [frame count, (dtype code, length, place) per frame]
HEADER_WORDS = 512  # 4 KiB: the fields of a round of up to about 32 sequences ride inline
_INLINE_BYTES = 8 * (HEADER_WORDS - _DIRECTORY)
# A receive with no deadline (the speculator between requests, however long the engine idles). Gloo times a
# receive out only as asked; a peer that dies closes the socket, which fails the receive at once.
_FOREVER = timedelta(days=365)


class ChannelClosed(RuntimeError):
    """The peer died, closed the connection, or did not answer in time."""


@dataclass(frozen=True)
class Frame:
    """One frame as the header describes it: ``offset`` is its byte offset in the inline area (INLINE only)."""
    dtype: torch.dtype
    numel: int
    place: int
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8  # every inline frame starts on a word, so it views as any dtype


def encode(frames: list[torch.Tensor], device_frames: bool) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                      list[torch.Tensor]]:
    """The header of ``frames`` (host frames that fit copied inline), the host frames that travel on their own
    and the device frames, in order. ``device_frames``: CUDA frames stay on their device (the NCCL link);
    otherwise they are host frames too."""
    if not 1 <= len(frames) <= MAX_FRAMES:
        raise ValueError(f"a message holds 1 to {MAX_FRAMES} tensors, got {len(frames)}")
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    inline = header.view(torch.uint8)[8 * _DIRECTORY:]
    directory, host, device, used = [len(frames)], [], [], 0
    for f in frames:
        if f.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {f.dtype} frame; the wire carries {_DTYPES}")
        flat = f.reshape(-1)
        if flat.is_cuda and device_frames and flat.numel():
            place = DEVICE
            device.append(flat.contiguous())
        else:
            # the Gloo link's host copy of a GPU frame (an EAGLE-3 target's features); an empty one needs none
            flat = flat.cpu() if flat.numel() else torch.empty(0, dtype=flat.dtype)
            nbytes = flat.numel() * flat.element_size()
            place = INLINE if used + nbytes <= _INLINE_BYTES else HOST
            if place == INLINE:
                inline[used:used + nbytes] = flat.contiguous().view(torch.uint8)
                used += _aligned(nbytes)
            else:
                host.append(flat.contiguous())
        directory += [_DTYPES.index(f.dtype), flat.numel(), place]
    header[:len(directory)] = torch.tensor(directory, dtype=torch.int64)
    return header, host, device


def decode(header: torch.Tensor) -> list[Frame]:
    """The frames a header describes: its directory, read to the host in one read."""
    count, *entries = header[:_DIRECTORY].tolist()
    out, used = [], 0
    for i in range(count):
        code, numel, place = entries[3 * i:3 * i + 3]
        frame = Frame(_DTYPES[code], numel, place, used)
        if place == INLINE:
            used += _aligned(frame.nbytes)
        out.append(frame)
    return out


def inline_view(header: torch.Tensor, frame: Frame) -> torch.Tensor:
    """An inline frame: a view of the header's bytes, no copy (each received header is a fresh tensor)."""
    start = 8 * _DIRECTORY + frame.offset
    return header.view(torch.uint8)[start:start + frame.nbytes].view(frame.dtype)


class Channel:
    """One end of the link. ``counters`` (``MessageCounters``) count the messages each rank has sent;
    they let a busy receiver check for a waiting message without blocking, which gloo's receive
    handles do not offer."""

    def __init__(self, rank: int, port: int, counters: "MessageCounters", backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 60.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {backend!r}")
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.counters = counters
        self.received = 0
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout)
        self.host = dist.ProcessGroupGloo(dist.PrefixStore("host/", self.store), rank, 2, timeout)
        self.gpu = None  # the NCCL group of device frames
        self._sending: list = []  # device sends not yet run: their work keeps their tensors alive
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # a transfer whose peer died mid-message fails instead of hanging the GPU
            self.gpu = dist.ProcessGroupNCCL(dist.PrefixStore("device/", self.store), rank, 2, options)

    def send(self, message: torch.Tensor | list[torch.Tensor]) -> None:
        frames = [message] if isinstance(message, torch.Tensor) else list(message)
        header, host, device = encode(frames, self.gpu is not None)
        self.counters.bump(self.rank)
        try:
            self.host.send([header], self.peer, 0).wait()
            for i, f in enumerate(host):
                self.host.send([f], self.peer, 1 + i).wait()
            # queued on the NCCL stream after the current stream's work that wrote them; the host does not wait,
            # and each transfer's work, kept until it has run, keeps its tensor alive
            self._sending = [w for w in self._sending if not w.is_completed()]
            self._sending += [self.gpu.send([f.to(self.device)], self.peer, 0) for f in device]
        except RuntimeError as e:
            raise ChannelClosed(f"send failed: {e}") from e

    def poll(self) -> bool:
        """Is a message from the peer waiting?"""
        return self.counters.count(self.peer) > self.received

    def recv(self, timeout_s: float | None = None, alive=lambda: True) -> list[torch.Tensor]:
        """The next message's tensors: host frames on the CPU, device frames on this end's device (ready for its
        current stream). Raise ``ChannelClosed`` when no message comes within ``timeout_s`` or the peer is gone.

        No polling: the wait blocks on the Gloo socket. A peer that dies closes it, which ends the wait at once,
        so ``alive()`` is only asked before waiting and, when the receive fails, to say why."""
        if not alive():
            raise ChannelClosed("peer process is gone")
        wait = _FOREVER if timeout_s is None else timedelta(seconds=timeout_s)
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)  # fresh: inline frames are views of it
        try:
            self.host.recv([header], self.peer, 0).wait(wait)
            self.received += 1
            frames, host_tag = [], 1
            for frame in decode(header):
                if frame.place == INLINE:
                    frames.append(inline_view(header, frame))
                    continue
                # a fresh buffer: served from the caching allocator's pool (on a GPU), and never one that an
                # earlier message's views still read
                buf = torch.empty(frame.numel, dtype=frame.dtype, device=self.device if frame.place == DEVICE
                                  else "cpu")
                if frame.place == HOST:
                    self.host.recv([buf], self.peer, host_tag).wait(wait)
                    host_tag += 1
                else:
                    self.gpu.recv([buf], self.peer, 0).wait()  # the current stream waits, not the host
                frames.append(buf)
        except RuntimeError as e:
            if not alive():
                raise ChannelClosed("peer process is gone") from e
            if "Timed out" in str(e) and timeout_s is not None:
                raise ChannelClosed(f"no message within {timeout_s:.1f} s") from e
            raise ChannelClosed(f"receive failed: {e}") from e
        return frames

    def close(self) -> None:
        """Drop this end. The NCCL group is aborted, not shut down: a transfer to a peer that died would never
        finish, and NCCL's watchdog would end this whole process at its timeout."""
        if self.gpu is not None and hasattr(self.gpu, "abort"):
            try:
                self.gpu.abort()
            except RuntimeError:
                pass
        self.host = self.gpu = None
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
