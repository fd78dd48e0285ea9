"""Counting the engine's reads from the device, on the CPU.

On a CPU every tensor is a host tensor, so a read cannot be told from its device. Instead, values are
followed: a model pass's logits are marked as device values, every torch op whose inputs include a
marked tensor marks its outputs (and the target of an in-place op), and turning a marked tensor into
Python values (``tolist``, ``item``, ``cpu``, ``numpy``, ``bool``/``int``/``float``) counts as one read:
on a GPU each would wait for the device. Host inputs (flags, positions, a request's own random draws)
stay unmarked, as they stay on the host there.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from benchmarks.build_counters import TorchCalls  # noqa: F401  (the torch-call counter, shared with the benchmark)

MARK = "_saguaro_on_device"
READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


def _tensors(*trees):
    return [t for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor)]


def mark(tensors) -> None:
    for t in _tensors(tensors):
        setattr(t, MARK, True)


class DeviceReads(TorchFunctionMode):
    # > 0 while a graph replays: on a GPU no Python runs in it, so what the CPU stand-in's run of it reads is not a
    # read of the host (a capture checks the graph reads nothing: ``CaptureChecker``)
    replaying = 0

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        marked = any(getattr(t, MARK, False) for t in inputs)
        if marked and func in READS and not DeviceReads.replaying:
            self.count += 1
        out = func(*args, **kwargs)
        if marked:
            name = getattr(func, "__name__", "")
            if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
                mark(args[0])  # written in place: its values now come from the device
            mark(out)
        return out


@contextmanager
def counting_device_reads(monkeypatch):
    """Marks the output of every ``ModelRunner.forward_flat`` pass; yields the running ``DeviceReads``."""
    from saguaro.engine.model_runner import ModelRunner
    real = ModelRunner.forward_flat

    def forward_flat(self, items):
        logits, counts = real(self, items)
        mark(logits)
        return logits, counts

    monkeypatch.setattr(ModelRunner, "forward_flat", forward_flat)
    with DeviceReads() as reads:
        yield reads


@contextmanager
def reads_per_call(monkeypatch, cls, method: str):
    """``counting_device_reads``, plus the reads of each call of ``cls.method``: yields the list it appends to."""
    counts: list[int] = []
    real = getattr(cls, method)

    def counted(self, *args, **kwargs):
        start = reads.count
        out = real(self, *args, **kwargs)
        counts.append(reads.count - start)
        return out

    monkeypatch.setattr(cls, method, counted)
    with counting_device_reads(monkeypatch) as reads:
        yield counts


def _replaying(replay):
    def replaying():
        DeviceReads.replaying += 1
        try:
            replay()
        finally:
            DeviceReads.replaying -= 1
    return replaying


def mark_graph_builds(monkeypatch) -> None:
    """Mark what a replay of the speculator's build graph (``GraphBuild.run``) or of the just-in-time drafter's
    steps graph (``DraftStepsGraph.run``) writes: device values on a GPU, like a pass's logits; the model passes
    inside them do not go through ``forward_flat``."""
    from saguaro.sd.draft_graph import DraftStepsGraph
    from saguaro.ssd.graph_build import GraphBuild
    real, real_graph = GraphBuild.run, GraphBuild._graph

    def graph(self, shape):
        host, staged, replay, out = real_graph(self, shape)
        return host, staged, _replaying(replay), out

    def run(self, shape, rows, *spoken):
        out = real(self, shape, rows, *spoken)
        mark([out.keys, out.tokens, out.rank_ids, out.rank_probs, out.probs])
        return out

    monkeypatch.setattr(GraphBuild, "run", run)
    monkeypatch.setattr(GraphBuild, "_graph", graph)
    real_steps, real_steps_graph = DraftStepsGraph.run, DraftStepsGraph._graph

    def steps_run(self, shape, first, rows):
        out = real_steps(self, shape, first, rows)
        mark([out.tokens, out.rank_ids, out.rank_probs])
        return out

    def steps_graph(self, shape):
        host, staged, feed, replay, out = real_steps_graph(self, shape)
        return host, staged, feed, _replaying(replay), out
    monkeypatch.setattr(DraftStepsGraph, "run", steps_run)
    monkeypatch.setattr(DraftStepsGraph, "_graph", steps_graph)
