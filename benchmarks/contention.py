"""Memory-bus contention: how much a busy draft on the other core slows the target's verification.

The two cores of this machine compute independently but share one memory bus (shared/MODELS.md).
This probe times one target verification pass (``rows`` tokens over a ``context``-token KV
cache, all logits, one thread on the target core), repeatedly:
  - with the other core idle (before and after the busy phases, to catch drift);
  - while a second process, pinned to the other core, runs draft forward passes back to back:
    1-row decode steps (they stream the draft's weights: the worst case for the bus) and
    ``width``-row passes (the shape of an SSD branch step: more compute per byte).
Both sides use the eager ``ModelRunner`` path in bf16 with made-up token ids (timing only).
Other tenants of a shared machine load the bus too; the load average is recorded next to it.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks.common import DRAFT, TARGET, log

BLOCK = 16


def _runner(model_name: str, context: int, rows: int) -> tuple[Any, list[int], list[int]]:
    from saguaro.engine.model_runner import ForwardItem, ModelRunner
    from saguaro.loading import load_model
    loaded = load_model(model_name, dtype=torch.bfloat16, progress=False)
    runner = ModelRunner(loaded.model, math.ceil((context + rows) / BLOCK) + 1, BLOCK)
    table: list[int] = []
    runner.blocks.reserve(table, context + rows)
    ids = [(1000 + 7 * i) % loaded.config.vocab_size for i in range(context + rows)]
    runner.forward([ForwardItem(ids[:context], 0, table, "none")])  # fill the cache once
    return runner, table, ids


def _busy_draft(ready: Any, stop: Any, steps: Any, cores: list[int], rows: int, context: int) -> None:
    """The busy process: draft forward passes of ``rows`` tokens, back to back, until told to stop."""
    from saguaro.engine.device import pin_process
    from saguaro.engine.model_runner import ForwardItem
    pin_process(cores, 1)
    runner, table, ids = _runner(DRAFT, context, rows)
    item = ForwardItem(ids[context:context + rows], context, table, "last")  # rewrites the same slots each time
    runner.forward([item])
    ready.set()
    while not stop.is_set():
        runner.forward([item])
        steps.value += 1


def measure(rows: int, widths: list[int], context: int = 256, reps: int = 8, target_cores: list[int] | None = None,
            draft_cores: list[int] | None = None) -> dict[str, Any]:
    """Target verification time alone and beside a busy draft, for each draft width."""
    from saguaro.engine.device import pin_process
    from saguaro.engine.model_runner import ForwardItem
    target_cores, draft_cores = target_cores or [0], draft_cores or [1]
    pin_process(target_cores, 1)
    log(f"contention probe: loading {TARGET}")
    runner, table, ids = _runner(TARGET, context, rows)
    item = ForwardItem(ids[context:context + rows], context, table, "all")

    def verify_times() -> list[float]:
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            runner.forward([item])
            out.append(1e3 * (time.perf_counter() - t))
        return out

    verify_times()  # warm-up
    idle_before = verify_times()
    log(f"contention probe: target {rows} rows alone: {statistics.median(idle_before):.0f} ms")
    busy = []
    ctx = mp.get_context("spawn")
    for width in widths:
        ready, stop, steps = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        proc = ctx.Process(target=_busy_draft, args=(ready, stop, steps, draft_cores, width, context), daemon=True,
                           name="saguaro-busy-draft")
        proc.start()
        try:
            if not ready.wait(600):
                raise RuntimeError("busy draft process did not start within 600 s")
            time.sleep(0.5)
            s0, t0 = steps.value, time.perf_counter()
            times = verify_times()
            rate = (steps.value - s0) / (time.perf_counter() - t0)
        finally:
            stop.set()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        busy.append({"draft_rows": width, "verify_ms": times, "verify_ms_median": statistics.median(times),
                     "draft_steps_per_s": rate})
        log(f"contention probe: target {rows} rows beside a busy {width}-row draft: "
            f"{statistics.median(times):.0f} ms ({rate:.1f} draft steps/s)")
    idle_after = verify_times()
    idle = statistics.median(idle_before + idle_after)
    for b in busy:
        b["slowdown"] = b["verify_ms_median"] / idle
    return {
        "description": "target verification pass (eager ModelRunner, bf16, 1 thread) alone vs beside a busy draft "
                       "process on the other core",
        "rows": rows, "context": context, "reps": reps, "target_cores": target_cores, "draft_cores": draft_cores,
        "idle_ms_before": idle_before, "idle_ms_after": idle_after, "idle_ms_median": idle,
        "busy": busy,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
