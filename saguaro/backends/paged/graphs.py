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
* **capture**: how a graph is made. ``CudaCapture`` records a CUDA graph (warm-up and capture on the
  runner's own stream, one memory pool shared by the runner's buckets, the largest captured first).
  ``EagerCapture`` is the CPU stand-in: it runs the step once under ``CaptureChecker`` (which raises
  on any host sync or data-dependent shape, as a capture would fail), and "replay" reruns the same
  function on the same static buffers into the same output tensor, so the bookkeeping (buckets,
  padding, buffer reuse, staging) is tested without a GPU.
* **start-up**: ``capture_all`` captures every bucket a runner can reach before it serves (the target
  before the speculator starts; the speculator thread before its ready reply), then seals the runner.
  ``torch.cuda.graph`` captures on one stream per process and synchronizes the device on entry, so a
  capture beside another thread's capture or sync breaks: captures take ``CAPTURE_LOCK``, one at a
  time, and none happens while rounds run. A pass with no graph after sealing runs eagerly, counted
  in ``uncaptured`` and logged.
* **staging**: a replay's per-row fields move in one host-to-device copy (``staging.py``).

Lifetimes: a graph reads its buffers, the model's weights and the KV cache by address. Each entry
keeps its buffers and the runner keeps the model and cache for as long as the graphs live; a freed
input would be reused by the allocator and the replay would read garbage. A replay also holds the
function it recorded, and so every tensor that function closes over (as the stand-in's replay does,
which reruns it): an input made for one capture alone stays alive with its graph.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from saguaro.backends.paged.capture_check import CaptureChecker
from saguaro.backends.paged.metadata import PagedMetadata
from saguaro.backends.paged.staging import GHOST, ROW_FIELDS, StagingLayout
from saguaro.kv.kv_cache import KVCache

log = logging.getLogger("saguaro.graphs")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# sequences per captured multi-step graph (the speculator's build, SD's draft steps): one graph per bucket
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CAPTURE_LOCK = threading.Lock()  # one capture at a time in the process, whichever thread or runner


def bucket_for(rows: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int | None:
    """The smallest bucket holding ``rows`` rows, or None past the largest (run eagerly)."""
    return next((b for b in buckets if b >= rows), None)


class CudaCapture:
    """Records ``fn`` as a CUDA graph on this capture's own stream; all graphs of a runner share one memory pool.

    Its own stream: cuBLAS keys its workspace by (handle, stream), so graphs of two runners captured on one
    stream would share a workspace, and replaying them at once on two streams could race."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy initialisation and kernel compilation stay out of the graph
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a colocated speculator thread may launch its own work while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            out = fn()
        return GraphReplay(graph, fn), out


@dataclass(frozen=True)
class GraphReplay:
    """A captured graph's replay. It keeps ``recorded`` alive: a tensor that only the recorded function closes
    over (the build's fork depths, say) would otherwise be freed and its memory reused under the graph."""
    graph: torch.cuda.CUDAGraph
    recorded: Callable[[], torch.Tensor]

    def __call__(self) -> None:
        self.graph.replay()


class EagerCapture:
    """The CPU stand-in: the step runs once under ``CaptureChecker`` (``check``), and replay recomputes it over
    the same buffers into the same output tensor."""

    def __init__(self, check: bool = True) -> None:
        self.check = check

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if self.check:
            with CaptureChecker():
                out = fn()
        else:
            out = fn()
        return (lambda: out.copy_(fn())), out


@dataclass
class _Graph:
    layout: StagingLayout  # B rows, E extra slots, tables MB wide
    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    meta: PagedMetadata  # static buffers: slot_mapping [B], block_tables [B, MB], per-row fields [B], extras [B, E]
    staged: torch.Tensor  # [layout.size] int64 on the device: what the graph unpacks into the buffers above
    host: torch.Tensor  # [layout.size] int64 on the host (pinned on a GPU): where a replay packs its pass
    copied: object  # GPU: an event after the last copy out of ``host`` (the next pack waits for it)
    logits: torch.Tensor  # [B, V] float32, written by each replay
    replay: Callable[[], None]
    features: torch.Tensor | None = None  # [B, len(taps) * hidden]: the tapped layers' inputs, when the net taps


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
        self.sealed = False  # set by capture_all: no capture after start-up
        self.uncaptured = 0  # passes that found no graph after start-up and ran eagerly
        self.capture_s = 0.0

    def fits(self, meta: PagedMetadata) -> bool:
        return (bucket_for(meta.num_rows, self.buckets) is not None
                and meta.block_tables.shape[1] <= self.max_table_blocks)

    def capture_all(self, max_rows: int | None = None, extras: tuple[int, ...] = (0,)) -> None:
        """Capture every bucket up to the one holding ``max_rows`` (all when None) for each extra-slot width,
        the largest first (smaller graphs then reuse its pool memory), then seal: later passes replay or run
        eagerly, never capture. Passes of more rows than the largest captured bucket run eagerly."""
        top = bucket_for(max_rows, self.buckets) if max_rows else None
        self.buckets = tuple(b for b in self.buckets if top is None or b <= top)
        t0 = time.perf_counter()
        for e in extras:
            for b in sorted(self.buckets, reverse=True):
                self._graph(b, e)
        self.capture_s = time.perf_counter() - t0
        self.sealed = True
        log.info("captured %d graphs (rows %s, extra slots %s) in %.2f s", len(self.graphs),
                 ",".join(map(str, self.buckets)), ",".join(map(str, extras)), self.capture_s)

    def _graph(self, rows: int, extras: int) -> _Graph | None:
        key = (rows, extras)
        if key not in self.graphs:
            if self.sealed:
                self.uncaptured += 1
                log.warning("no graph for %d rows with %d extra slots after start-up: the pass runs eagerly",
                            rows, extras)
                return None
            with CAPTURE_LOCK:
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
        layout = StagingLayout(rows, extras, self.max_table_blocks)
        host = torch.zeros(layout.size, dtype=long, pin_memory=dev.type == "cuda")
        for name in ROW_FIELDS:  # all ghosts (slot -1, not 0): the capture's run writes no sequence's cache slot
            layout.row_field(host, name)[:] = GHOST[name]
        staged = host.to(dev, copy=True)
        taps = getattr(self.net, "taps", ())
        features = torch.zeros(rows, len(taps) * self.net.config.hidden_size, dtype=self.net.embed.dtype,
                               device=dev) if taps else None  # an EAGLE-3 draft's target features, captured too

        def step() -> torch.Tensor:
            layout.unpack(staged, positions, meta)
            logits = self.net.logits(self.net(ids, positions, self.cache, meta))
            if features is not None:
                features.copy_(self.net.tapped)
            return logits

        with torch.inference_mode():
            replay, logits = self.capture(step)
        log.debug("captured a forward graph for %d rows, %d extra slots", rows, extras)
        return _Graph(layout, ids, positions, meta, staged, host, None, logits, replay, features)

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata) -> torch.Tensor | None:
        """Logits [N, V] of the pass (a view of the graph's output: read it before the next replay), or None
        where no graph holds it after start-up (the caller runs it eagerly)."""
        n = meta.num_rows
        g = self._graph(bucket_for(n, self.buckets), meta.max_extras)
        if g is None:
            return None
        if g.copied is not None:
            g.copied.synchronize()  # the previous replay's copy out of the pinned buffer has run
        host_ids = input_ids.device.type == "cpu"
        used = g.layout.pack(g.host, input_ids if host_ids else None, positions, meta)
        g.staged[:used].copy_(g.host[:used], non_blocking=True)  # the one host-to-device copy of the pass
        if g.staged.is_cuda:
            g.copied = torch.cuda.Event()
            g.copied.record()
        if host_ids:
            g.ids.copy_(g.layout.row_field(g.staged, "ids"))
        else:  # ids sampled on the device by the previous step: never through the host
            g.ids[:n].copy_(input_ids)
            g.ids[n:].zero_()
        g.replay()
        if g.features is not None:  # copied out: the next replay overwrites the graph's buffer
            self.net.tapped = g.features[:n].clone()
        return g.logits[:n]

    def close(self) -> None:
        self.graphs.clear()
