"""Memory-bus contention: how much a busy draft on the other core slows the target's verification.

The two cores of this machine compute independently but share one memory bus.
In SSD the draft builds its tree while the target verifies, so a hit round lasts one verification
*slowed by the draft's traffic*, not one verification alone; a profile that ignores this predicts
too much (Thm 2's T_SD is "verify time" as it runs beside the draft).

The probe times one target verification pass (``rows`` tokens over a ``context``-token KV cache, all
logits, one thread on the target core):
  - with the other core idle (before and after the busy phases, to catch drift);
  - while a second process, pinned to the other core, runs draft forward passes back to back, of each
    width in ``widths`` (1 row streams the draft's weights fastest: the worst case for the bus; wider
    passes, the shape of a branch step, do more compute per byte).
It also counts the draft's passes per second meanwhile, so the draft's own slowdown is known too, and,
with the bytes each pass streams (``bus.pass_bytes``), the total the bus carried: the target's bytes per
verification over its time plus the draft's bytes per pass times its pass rate.
Both sides run as the engine runs them (fast path, the draft in its format) with made-up token ids.
Other tenants of a shared machine load the bus too; the load average is recorded next to it.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from saguaro.calibration.bus import pass_bytes
from saguaro.calibration.profile import BusyDraft, ContentionProbe
from saguaro.calibration.timer import RowTimer, runner_factory
from saguaro.cores import default_draft_cores, default_target_cores, pin_process
from saguaro.loading.place import load_or_place
from saguaro.models.draft_format import DraftFormat


def _busy_draft(ready: Any, stop: Any, passes: Any, nbytes: Any, draft: Any, dtype: torch.dtype, fmt: DraftFormat,
                enforce_eager: bool, cores: list[int], rows: int, context: int) -> None:
    """The busy process: draft forward passes of ``rows`` tokens, back to back, until told to stop."""
    pin_process(cores, 1)
    loaded = load_or_place(draft, "cpu", fmt.dtype(dtype), progress=False)
    timer = RowTimer(runner_factory(loaded, enforce_eager, fmt), context, rows)
    timer.once(rows)
    nbytes.value = pass_bytes(timer.runner)
    ready.set()
    while not stop.is_set():
        timer.once(rows)
        passes.value += 1


def measure(target: Any, draft: Any, rows: int, widths: list[int], *, dtype: torch.dtype = torch.bfloat16,
            enforce_eager: bool = True, draft_format: DraftFormat = DraftFormat(), context: int = 256, reps: int = 8,
            target_cores: list[int] | None = None, draft_cores: list[int] | None = None,
            log=lambda s: None, target_weights: str = "bf16") -> ContentionProbe:
    """Target verification time alone and beside a busy draft, for each draft width.

    ``target`` / ``draft``: model names (loaded here and in the busy process) or ``LoadedModel``s. The
    caller's process is pinned to ``target_cores`` with one thread meanwhile, then restored."""
    target_cores, draft_cores = target_cores or default_target_cores(True), draft_cores or default_draft_cores(True)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    pin_process(target_cores, 1)
    try:
        return _measure(target, draft, rows, widths, dtype, enforce_eager, draft_format, context, reps, target_cores,
                        draft_cores, log, target_weights)
    finally:
        pin_process(sorted(affinity) if affinity else None, threads)


def _measure(target, draft, rows, widths, dtype, enforce_eager, draft_format, context, reps, target_cores, draft_cores,
             log, target_weights) -> ContentionProbe:
    verify = RowTimer(runner_factory(load_or_place(target, "cpu", dtype, progress=False), enforce_eager,
                                     target_weights=target_weights), context, rows)

    def verify_times() -> list[float]:
        return [1e3 * verify.once(rows) for _ in range(reps)]

    target_bytes, draft_bytes = pass_bytes(verify.runner), 0
    verify_times()  # warm-up
    idle_before = verify_times()
    log(f"contention probe: target {rows} rows alone: {statistics.median(idle_before):.0f} ms")
    busy = []
    ctx = mp.get_context("spawn")
    for width in widths:
        ready, stop, passes, nbytes = ctx.Event(), ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
        proc = ctx.Process(target=_busy_draft, args=(ready, stop, passes, nbytes, draft, dtype, draft_format,
                                                     enforce_eager, draft_cores, width, context),
                           daemon=True, name="saguaro-busy-draft")
        proc.start()
        try:
            while not ready.wait(0.5):
                if not proc.is_alive():
                    raise RuntimeError(f"busy draft process exited during start-up (exit code {proc.exitcode})")
            time.sleep(0.5)
            p0, t0 = passes.value, time.perf_counter()
            times = verify_times()
            deadline = time.perf_counter() + 10.0  # a draft starved of its core (other load) still counts a pass
            while passes.value == p0 and time.perf_counter() < deadline and proc.is_alive():
                time.sleep(0.01)
            rate = (passes.value - p0) / (time.perf_counter() - t0)
        finally:
            stop.set()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        draft_bytes = nbytes.value
        median = statistics.median(times)
        busy.append(BusyDraft(draft_rows=width, slowdown=0.0, draft_passes_per_s=rate, verify_ms=times,
                              verify_ms_median=median,
                              bus_bytes_per_s=target_bytes / (median / 1e3) + draft_bytes * rate))
        log(f"contention probe: target {rows} rows beside a busy {width}-row draft: "
            f"{statistics.median(times):.0f} ms ({rate:.1f} draft passes/s)")
    idle_after = verify_times()
    idle = statistics.median(idle_before + idle_after)
    for b in busy:
        b.slowdown = b.verify_ms_median / idle
    return ContentionProbe(
        description="target verification pass (1 thread) alone vs beside a busy draft process on the other core",
        rows=rows, context=context, reps=reps, enforce_eager=bool(enforce_eager), draft_format=draft_format.tag,
        target_cores=target_cores, draft_cores=draft_cores,
        target_pass_bytes=target_bytes, draft_pass_bytes=draft_bytes,
        idle_ms_before=idle_before, idle_ms_after=idle_after, idle_ms_median=idle,
        busy=busy,
        loadavg=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)

