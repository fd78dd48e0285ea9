"""Greedy draft steps as one captured graph (the paged backend: a CUDA graph on a GPU, the checked stand-in on
the CPU), so that a round's host work does not grow with K.

SD: the first step stays a pass of the runner: it feeds what the draft has not seen (the tokens the last round
appended, a variable count). Steps 2..K feed back the last step's argmax, one row per sequence, at positions
``base + j``; the graph does that on the device, K - 1 passes and their argmaxes, from one staging copy of each
sequence's base position and block table.

The SSD speculator's just-in-time drafts after a miss: the draft cache holds every token but the last one (the
build's glue fed the whole speculation, the outcome kept its accepted part), so the first step feeds one token
too and the graph runs all K steps (``StepsShape.first``), from the staged last token. It also keeps each
step's ranked ids (``StepsShape.ranked``), which the next build reuses.

It serves greedy rounds only: every sequence greedy, the same K for all, no reweighting (``DraftModelProposer``
runs the steps one by one otherwise).

Staging row of a sequence (int64): valid | base | token | table [MB], where ``base`` is the position the graph's
first step feeds and ``token`` what it feeds there (``first`` only).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from saguaro.backends.paged.graphs import CAPTURE_LOCK
from saguaro.backends.paged.metadata import PagedMetadata
from saguaro.backends.paged.graphs import SEQ_BUCKETS
from saguaro.sampling.ranked import rank_table


@dataclass(frozen=True)
class StepsShape:
    seqs: int  # B, a bucket (ghost sequences pad it)
    steps: int  # K - 1 steps in the graph (K with ``first``)
    table_width: int  # MB
    first: bool = False  # the graph runs the first step too, feeding the staged token
    ranked: int = 0  # W: ranked ids kept per step (0: none)


@dataclass
class StepsOutputs:
    """A replay's results, in the graph's static buffers: read or copy them before its next replay."""
    tokens: torch.Tensor  # [B, steps] long
    rank_ids: torch.Tensor | None  # [B, steps, W] long, with ``ranked``
    rank_probs: torch.Tensor | None  # [B, steps, W] float32


class DraftStepsGraph:
    """The steps graphs of one draft (``PagedCausalLM`` over its KV cache), captured per ``StepsShape`` on first
    use with the paged backend's capture (SD has no thread beside the target, so no capture runs beside it)."""

    def __init__(self, net, cache, capture: Callable, device: torch.device, table_width: int):
        self.net, self.cache, self.capture, self.device, self.table_width = net, cache, capture, device, table_width
        self.graphs: dict[StepsShape, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], None],
                                            StepsOutputs]] = {}
        self._copied = None  # on a GPU: an event after the last staging copy

    def shape(self, seqs: int, k: int, ranked: int = 0) -> StepsShape | None:
        """SD's steps 2..K; with ``ranked`` > 0 the just-in-time drafter's K steps, W = ``ranked`` ids kept."""
        bucket = next((b for b in SEQ_BUCKETS if b >= seqs), None)
        if bucket is None or k < (1 if ranked else 2):
            return None
        return StepsShape(bucket, k, self.table_width, True, ranked) if ranked else StepsShape(bucket, k - 1,
                                                                                             self.table_width)

    def capture_all(self, max_seqs: int, max_k: int, ranked: int = 0) -> None:
        """Capture every shape a greedy round of at most ``max_seqs`` sequences and K <= ``max_k`` takes, now
        (start-up): no round then stops to capture."""
        largest = min(max_seqs, SEQ_BUCKETS[-1])
        for seqs in sorted({next(b for b in SEQ_BUCKETS if b >= n) for n in range(1, largest + 1)}):
            for k in range(1 if ranked else 2, max_k + 1):
                self._graph(self.shape(seqs, k, ranked))

    @torch.inference_mode()
    def run(self, shape: StepsShape, first: torch.Tensor | None, rows: list[list[int]]) -> StepsOutputs:
        """Steps 2..K from the first step's tokens ``first`` [n] (None with ``shape.first``: all K steps, from the
        staged tokens) and the staging ``rows``: the tokens [B, steps] (rows past n are ghosts), and the ranked
        ids, in the graph's buffers (read them before the next replay)."""
        host, staged, feed, replay, out = self._graph(shape)
        if self._copied is not None:
            self._copied.synchronize()  # the last round's copy out of its pinned buffer has run (long since)
        host[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
        host[len(rows):] = 0
        staged.copy_(host, non_blocking=True)
        if staged.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if first is not None:
            feed[:len(rows)] = first
        replay()
        return out

    def _graph(self, shape: StepsShape):
        if shape not in self.graphs:
            with CAPTURE_LOCK:
                self.graphs[shape] = self._make(shape)
        return self.graphs[shape]

    @torch.inference_mode()
    def _make(self, shape: StepsShape):
        b, dev = shape.seqs, self.device
        host = torch.zeros(b, 3 + shape.table_width, dtype=torch.int64, pin_memory=dev.type == "cuda")
        staged = host.to(dev, copy=True)  # all ghosts: the capture writes no cache slot
        feed = torch.zeros(b, dtype=torch.long, device=dev)
        w = shape.ranked
        out = StepsOutputs(torch.zeros(b, shape.steps, dtype=torch.long, device=dev),
                           torch.zeros(b, shape.steps, w, dtype=torch.long, device=dev) if w else None,
                           torch.zeros(b, shape.steps, w, device=dev) if w else None)
        replay, _ = self.capture(lambda: self._steps(shape, staged, feed, out))
        return host, staged, feed, replay, out

    def _steps(self, shape: StepsShape, staged: torch.Tensor, feed: torch.Tensor, out: StepsOutputs
               ) -> torch.Tensor:
        b, bs = shape.seqs, self.cache.block_size
        valid, base, table = staged[:, 0] != 0, staged[:, 1], staged[:, 3:]
        groups = torch.arange(b, dtype=torch.int32, device=self.device)
        token = staged[:, 2] if shape.first else feed
        for j in range(shape.steps):
            pos = base + j
            block = table.gather(1, (pos // bs).clamp(max=shape.table_width - 1)[:, None])[:, 0]
            meta = PagedMetadata(torch.where(valid, block * bs + pos % bs, -1), table.to(torch.int32), groups,
                                 torch.where(valid, pos + 1, 0).to(torch.int32),
                                 torch.zeros(b, 0, dtype=torch.long, device=self.device),
                                 torch.zeros(b, dtype=torch.int32, device=self.device), bs)
            hidden = self.net(torch.where(valid, token, 0), torch.where(valid, pos, 0), self.cache, meta)
            logits = self.net.logits(hidden)
            if shape.ranked:
                top = rank_table(logits, shape.ranked)
                out.rank_ids[:, j] = top.ids
                out.rank_probs[:, j] = top.probs
            token = logits.argmax(dim=-1)
            out.tokens[:, j] = token
        return out.tokens


def steps_graph(runner) -> DraftStepsGraph | None:
    """The runner's draft-steps graph where it runs the paged backend with graphs (a GPU's, or the stand-in)."""
    from saguaro.backends.paged.backend import PagedBackend
    backend = getattr(runner, "backend", None)
    graphs = getattr(backend, "graphs", None)
    if not isinstance(backend, PagedBackend) or graphs is None:
        return None
    return DraftStepsGraph(backend.net, runner.cache, graphs.capture, runner.device, graphs.max_table_blocks)
