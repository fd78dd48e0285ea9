"""The target's features of one sequence, as an SSD speculator with an EAGLE-3 head keeps them.

Position p's feature g_p is the input of the target's aux layers when it processed token x_p ([A*H_t]). They
arrive in the messages (``ssd/protocol.py``): a prefill chunk's rows with ``CMD_PREFILL``, a round's verified
positions with the outcome. The log grows in place (its capacity doubles), so a round appends k+1 rows without
copying the ones before.
"""
from __future__ import annotations

import torch


class FeatureLog:
    """g_0..g_{n-1} of one sequence: the positions the target has processed and sent."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def put(self, start: int, rows: torch.Tensor) -> None:
        """Set positions start..start+len(rows)-1 (dropping any after them): a chunk, a round's verified
        positions, or a re-prefill from an earlier position."""
        if not 0 <= start <= self._len:
            raise RuntimeError(f"target features from position {start} arrive, but only {self._len} are known")
        end = start + len(rows)
        if self._buf is None or end > len(self._buf) or self._buf.shape[1] != rows.shape[1]:
            grown = torch.empty(max(2 * end, 16), rows.shape[1], dtype=rows.dtype, device=self.device)
            if self._buf is not None and self._buf.shape[1] == rows.shape[1]:
                grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:end] = rows
        self._len = end

    def span(self, start: int, end: int) -> torch.Tensor:
        """[end-start, A*H_t] the features of positions start..end-1 (a view)."""
        if self._buf is None or not 0 <= start <= end <= self._len:
            raise RuntimeError(f"target features {start}..{end - 1} requested, {self._len} are known")
        return self._buf[start:end]


def fence_features(tensors: list[torch.Tensor | None]) -> "torch.cuda.Event | None":
    """Producer side (the target's thread): an event recorded on its current stream after the features in
    ``tensors`` were written, or None when none is on a GPU. The consumer waits on it (``cross_fence``): it copies
    them on a stream of its own, which nothing else orders after the target's pass."""
    cuda = [t for t in tensors if t is not None and t.is_cuda]
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cuda[0].device))
    return event


def cross_fence(event: "torch.cuda.Event | None", tensors: list[torch.Tensor | None]) -> None:
    """Consumer side (the speculator's thread): order its current stream after ``event`` and tell the caching
    allocator the features are used there too (else their memory could go back to the target's stream while this
    one still reads them)."""
    if event is None:
        return
    stream = None
    for t in tensors:
        if t is not None and t.is_cuda:
            stream = stream or torch.cuda.current_stream(t.device)
            t.record_stream(stream)
    if stream is not None:
        stream.wait_event(event)
