"""The memory bus, measured: what one core streams alone, what both stream together, and the bytes
a model streams per forward pass. These are the inputs of ``saguaro.theory.bandwidth``, the
ceiling on SSD when the target and the draft share one bus.

The stream is a sum over a 1 GiB buffer, in 2 MB pages where the fast kernels can allocate them,
as the packed weights are. Each core runs its own process, pinned, with one thread, as the engine
runs the target and the speculator. With both cores the processes start together and each counts
the bytes it read in the same window; their sum is B_2. Other tenants of a shared machine load the
bus too, so the load average is recorded next to it.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from saguaro.cores import pin_process
from saguaro.engine.model_runner import ModelRunner
from saguaro.backends.cpu_kernels import build as kernels

GIB = 1 << 30


def _buffer(nbytes: int) -> torch.Tensor:
    try:
        raw = kernels.load().alloc_huge(nbytes)
    except kernels.KernelsUnavailable:
        raw = torch.empty(nbytes, dtype=torch.uint8)
    return raw.view(torch.float32).fill_(1.0)


def _stream(core: int, nbytes: int, seconds: float, ready: Any, go: Any, rate: Any) -> None:
    pin_process([core], 1)
    x = _buffer(nbytes)
    x.sum()
    ready.set()
    go.wait()
    start, sums = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        x.sum()
        sums += 1
    rate.value = sums * x.numel() * 4 / (time.perf_counter() - start)


def stream_rates(cores: list[int], seconds: float = 3.0, nbytes: int = GIB) -> list[float]:
    """Bytes per second each of ``cores`` streams while all of them stream at once."""
    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in cores]
    go = ctx.Event()
    rates = [ctx.Value("d", 0.0) for _ in cores]
    procs = [ctx.Process(target=_stream, args=(c, nbytes, seconds, r, go, v), daemon=True, name="saguaro-stream")
             for c, r, v in zip(cores, ready, rates)]
    for p in procs:
        p.start()
    try:
        for p, r in zip(procs, ready):
            while not r.wait(0.5):
                if not p.is_alive():
                    raise RuntimeError(f"bus probe process exited during start-up (exit code {p.exitcode})")
        go.set()
        for p in procs:
            p.join(timeout=seconds + 60)
            if p.exitcode != 0:
                raise RuntimeError(f"bus probe process failed (exit code {p.exitcode})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [v.value for v in rates]


def measure_bus(cores: list[int] | None = None, seconds: float = 3.0, reps: int = 3, nbytes: int = GIB,
                log=lambda s: None) -> dict[str, Any]:
    """B_1 (each core alone, the best core's median over ``reps`` windows) and B_2 (all ``cores`` at once,
    the median total), in bytes per second."""
    cores = cores or [0, 1]
    alone = {c: [stream_rates([c], seconds, nbytes)[0] for _ in range(reps)] for c in cores}
    together = [stream_rates(cores, seconds, nbytes) for _ in range(reps)]
    bus_alone = max(statistics.median(v) for v in alone.values())
    bus_total = statistics.median(sum(t) for t in together)
    log(f"bus probe: one core alone {bus_alone / 1e9:.1f} GB/s, cores {cores} together {bus_total / 1e9:.1f} GB/s")
    return {
        "description": "sum over a 1 GiB buffer per core (one process, one thread each): alone, then all at once",
        "cores": cores, "seconds": seconds, "reps": reps, "bytes": nbytes,
        "alone_bytes_per_s": {str(c): v for c, v in alone.items()},
        "together_bytes_per_s": together,
        "bus_alone": bus_alone, "bus_total": bus_total,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def pass_bytes(runner: ModelRunner) -> int:
    """Bytes of weights one forward pass of ``runner`` streams: the fast path's packed arena (every matrix
    and the head, in the runner's weight format), or the eager model's parameters less the embedding
    table (a pass reads only its rows), the head counted once when tied to it."""
    arena = getattr(runner.net, "arena", None)
    if arena is not None:
        return arena.numel() * arena.element_size()
    model = runner.model
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embed = model.model.embed_tokens.weight
    return sum(unique.values()) - (0 if model.config.tie_word_embeddings else embed.numel() * embed.element_size())
