"""CUDA graphs of one model's forward pass, one per bucket, replayed over static buffers.

Why: on a GPU an eager pass spends most of its time launching kernels (about 30 ms against 4 ms
of GPU work for the 1.5B target). A captured graph launches them all at once. A graph replays
fixed shapes and fixed addresses, so each bucket owns static buffers (input ids, positions, the
paged metadata, the logits it writes) and a pass is copied into them, padded with ghost rows.

Terms
-----
* **bucket**: a row count a graph was captured for (``ROW_BUCKETS``); a pass of N rows replays the
  smallest bucket B >= N. A pass of B_max rows or more runs eagerly (prefill of long prompts).
  Decode passes have one row per sequence, verification K+1, a draft step one, an SSD tree step its
  width, so one row-count ladder serves every pass kind. Graphs are keyed by (B, E), E being the
  width of the per-row extra slots (0 for causal passes, j+1 at SSD tree step j).
* **ghost row**: padding in rows N..B-1: slot -1 (writes nothing), nothing visible (output 0),
  token 0 at position 0. Its logits are computed and ignored.
* **capture**: how a graph is made. ``CudaCapture`` records a CUDA graph (warm-up on a side stream,
  one memory pool shared by every bucket, the largest captured first). ``EagerCapture`` is the CPU
  stand-in: "replay" reruns the same function on the same static buffers and writes the same output
  tensor, so the bookkeeping (buckets, padding, buffer reuse) is tested without a GPU.

Lifetimes: a graph reads its buffers, the model's weights and the KV cache by address. Each entry
keeps its buffers and the runner keeps the model and cache for as long as the graphs live; a freed
input would be reused by the allocator and the replay would read garbage.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from saguaro.device import copy_into
from saguaro.kv.kv_cache import KVCache
from saguaro.backends.paged.metadata import PagedMetadata

log = logging.getLogger("saguaro.graphs")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_for(rows: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int | None:
    """The smallest bucket holding ``rows`` rows, or None past the largest (run eagerly)."""
    return next((b for b in buckets if b >= rows), None)


class CudaCapture:
    """Records ``fn`` as a CUDA graph; all graphs of a runner share one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy initialisation and kernel compilation stay out of the graph
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a colocated speculator thread may launch its own work while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


class EagerCapture:
    """The CPU stand-in: replay recomputes ``fn`` over the same buffers into the same output tensor."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        return (lambda: out.copy_(fn())), out


@dataclass
class _Graph:
    rows: int  # B
    extras: int  # E
    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    meta: PagedMetadata  # static buffers: slot_mapping [B], block_tables [B, MB], per-row fields [B], extras [B, E]
    logits: torch.Tensor  # [B, V] float32, written by each replay
    replay: Callable[[], None]


class GraphRunner:
    """Replays ``net``'s forward (hidden states and the head's logits for every row) per bucket."""

    def __init__(self, net, cache: KVCache, device: torch.device, capture: Callable, max_table_blocks: int,
                 buckets: tuple[int, ...] = ROW_BUCKETS):
        self.net = net
        self.cache = cache  # referenced here too: the graphs write it by address
        self.device = device
        self.capture = capture
        self.max_table_blocks = max_table_blocks  # MB: the widest block table a graph can hold
        self.buckets = buckets
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def fits(self, meta: PagedMetadata) -> bool:
        return (bucket_for(meta.num_rows, self.buckets) is not None
                and meta.block_tables.shape[1] <= self.max_table_blocks)

    def capture_all(self, extras: tuple[int, ...] = (0,)) -> None:
        """Capture every bucket up front, the largest first (smaller graphs then reuse its pool memory)."""
        for e in extras:
            for b in sorted(self.buckets, reverse=True):
                self._graph(b, e)

    def _graph(self, rows: int, extras: int) -> _Graph:
        key = (rows, extras)
        if key not in self.graphs:
            self.graphs[key] = self._make(rows, extras)
        return self.graphs[key]

    def _make(self, rows: int, extras: int) -> _Graph:
        dev, long, i32 = self.device, torch.int64, torch.int32
        meta = PagedMetadata(
            slot_mapping=torch.full((rows,), -1, dtype=long, device=dev),
            block_tables=torch.zeros(rows, self.max_table_blocks, dtype=i32, device=dev),
            row_group=torch.zeros(rows, dtype=i32, device=dev),
            prefix_len=torch.zeros(rows, dtype=i32, device=dev),
            extra_slots=torch.zeros(rows, extras, dtype=long, device=dev),
            extra_len=torch.zeros(rows, dtype=i32, device=dev),
            block_size=self.cache.block_size)
        ids = torch.zeros(rows, dtype=long, device=dev)
        positions = torch.zeros(rows, dtype=long, device=dev)

        def step() -> torch.Tensor:
            return self.net.logits(self.net(ids, positions, self.cache, meta))

        with torch.inference_mode():
            replay, logits = self.capture(step)  # every row a ghost: the capture writes no cache slot
        log.debug("captured a forward graph for %d rows, %d extra slots", rows, extras)
        return _Graph(rows, extras, ids, positions, meta, logits, replay)

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Logits [N, V] of the pass (a view of the graph's output: read it before the next replay)."""
        n = meta.num_rows
        g = self._graph(bucket_for(n, self.buckets), meta.max_extras)
        # per-row fields are padded to the bucket on the host, so one copy also resets the ghost rows
        copy_into(g.ids[:n], input_ids)
        if g.rows > n:
            g.ids[n:].zero_()
        copy_into(g.positions, _pad(positions, g.rows, 0))
        copy_into(g.meta.slot_mapping, _pad(meta.slot_mapping, g.rows, -1))
        copy_into(g.meta.row_group, _pad(meta.row_group, g.rows, 0))
        copy_into(g.meta.prefix_len, _pad(meta.prefix_len, g.rows, 0))
        copy_into(g.meta.extra_len, _pad(meta.extra_len, g.rows, 0))
        if g.extras:
            copy_into(g.meta.extra_slots[:n], meta.extra_slots)
        groups, width = meta.block_tables.shape
        copy_into(g.meta.block_tables[:groups, :width], meta.block_tables)
        g.replay()
        return g.logits[:n]

    def close(self) -> None:
        self.graphs.clear()


def _pad(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0],), value)])
