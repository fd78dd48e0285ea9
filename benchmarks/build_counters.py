"""The SSD speculator's host work, counted: torch calls per build and device reads per round (``bench gpu --mode
ssd``'s columns), and the switches its rows need (which build, which backend).

* torch calls: every torch function, method and tensor operator the host calls in ``Speculator.build``
  (a ``TorchFunctionMode``); a replay of the build graph counts as one, as on a GPU it is one launch.
* device reads: the speculator's reads of device values per round (in its ``respond`` and ``build``). Every read
  it makes goes through ``read_together``, which is counted in the modules that call it. The verifier's own read
  of its outcome is not the speculator's and is not counted.

Counting slows the build (the mode sees every call), so the benchmark counts in a short run of its own, after the
timed one.
"""
from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from statistics import median
from typing import Iterator
from unittest import mock

from torch.overrides import TorchFunctionMode


class TorchCalls(TorchFunctionMode):
    """Counts the torch calls the host makes; ``replayed`` wraps a graph replay to count as one call."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def replayed(self, replay):
        def counted():
            if self.paused:
                return replay()
            self.count += 1
            self.paused = True
            try:
                return replay()
            finally:
                self.paused = False
        return counted


@dataclass
class BuildCounts:
    calls: list[int] = field(default_factory=list)  # torch calls of each build
    reads: int = 0  # the speculator's device reads, all rounds
    rounds: int = 0  # its responses
    graph_builds: int = 0  # builds that replayed the build graph

    @property
    def torch_calls_per_build(self) -> float | None:
        return median(self.calls) if self.calls else None

    @property
    def device_reads_per_round(self) -> float | None:
        return self.reads / self.rounds if self.rounds else None


@contextmanager
def counting() -> Iterator[BuildCounts]:
    """Count the builds, responses and reads of every speculator (in a thread of this process) meanwhile."""
    from saguaro.device import read_together
    from saguaro.ssd.graph_build import GraphBuild
    from saguaro.ssd.speculator import Speculator
    counts, local = BuildCounts(), threading.local()
    real_build, real_respond, real_graph, real_replay = (Speculator.build, Speculator.respond, GraphBuild._graph,
                                                         Speculator._replay_build)

    def build(self, *a, **kw):
        local.calls = calls = TorchCalls()
        local.speculating = True
        try:
            with calls:  # whole builds, never cut short by the next request: counts of a build, whatever the load
                out = real_build(self, lambda: False)
        finally:
            local.speculating = False
        counts.calls.append(calls.count)
        return out

    def respond(self, *a, **kw):
        counts.rounds += 1
        local.speculating = True
        try:
            return real_respond(self, *a, **kw)
        finally:
            local.speculating = False

    def graph(self, shape):
        host, staged, replay, out = real_graph(self, shape)
        calls = getattr(local, "calls", None)  # None: the start-up capture, outside any build
        return host, staged, replay if calls is None else calls.replayed(replay), out

    def replay_build(self, *a, **kw):
        counts.graph_builds += 1
        return real_replay(self, *a, **kw)

    def reads(tensors):
        counts.reads += bool(tensors) and getattr(local, "speculating", False)
        return read_together(tensors)
    with ExitStack() as stack:
        for target, value in [("saguaro.ssd.speculator.Speculator.build", build),
                              ("saguaro.ssd.speculator.Speculator.respond", respond),
                              ("saguaro.ssd.speculator.Speculator._replay_build", replay_build),
                              ("saguaro.ssd.graph_build.GraphBuild._graph", graph),
                              ("saguaro.ssd.speculator.read_together", reads),
                              ("saguaro.ssd.cache.read_together", reads),
                              ("saguaro.sampling.ranked.read_together", reads)]:
            stack.enter_context(mock.patch(target, value))
        yield counts


@contextmanager
def build_kind(graph: bool, paged: bool) -> Iterator[None]:
    """The speculator's graph build on or off; ``paged``: every runner on the paged backend (on a CPU, its stand-in,
    where the graph build runs too; on a GPU it is the default already)."""
    from saguaro.ssd.speculator import Speculator
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(Speculator, "graph_build", graph))
        if paged:
            import saguaro.engine.model_runner as model_runner
            real = model_runner.make_backend

            def make_paged(model, cache, device, enforce_eager, weights, head_ids, kind, graphs, **kw):
                return real(model, cache, device, enforce_eager, weights, head_ids, "paged", graphs, **kw)
            stack.enter_context(mock.patch.object(model_runner, "make_backend", make_paged))
        yield
