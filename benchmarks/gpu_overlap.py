"""A bounded overlap probe: a verification graph on one stream while draft graphs replay on another.

SSD on one GPU gains only if the draft's build runs beside the target's verification. This probe measures
just that, with the engine's own graphs: a 1.5B-shape verification of ``--verify-rows`` rows and a 0.5B-shape
draft step (random weights of real shapes, ``benchmarks/synthetic.py``), each runner's graphs captured at its
start-up on its own capture stream. Then, per repeat, ``--draft-steps`` draft replays go on one stream and
one verification replay on another, and CUDA events time the verification: alone against beside the draft.

A run on two streams of one process once hung (``/work/shared/GPU.md``), so the measurement runs in a child
process under a watchdog: past ``--watchdog-s`` the child is killed and the probe reports "hung" instead of
hanging the GPU check. Without CUDA it reports "skipped". Everything but the child's measurement runs anywhere
(``scripts/gpu_check.sh --dry-run`` imports it).

    python -m benchmarks.gpu_overlap --watchdog-s 30 --out results
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, log, table, write_results

STATUSES = ("ok", "skipped", "hung", "failed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen2.5-1.5b", help="the verifying model's shape")
    p.add_argument("--draft", default="qwen2.5-0.5b", help="the draft's shape")
    p.add_argument("--verify-rows", type=int, default=5, help="rows of the verification (K+1, default 5)")
    p.add_argument("--draft-steps", type=int, default=4, help="draft replays launched beside each verification")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--watchdog-s", type=float, default=30.0, help="kill the measurement after this long (default 30)")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--name", default="gpu_overlap")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the measurement itself
    return p.parse_args(argv)


def watched(argv: list[str], watchdog_s: float) -> dict[str, Any]:
    """Run the measurement in a child process (its own session, so the whole group can be killed); its last
    stdout line is its JSON result."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_overlap", *argv, "--child"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        out, _ = child.communicate(timeout=watchdog_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"status": "hung", "detail": f"no result within {watchdog_s:.0f} s: the child was killed"}
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if child.returncode != 0 or not lines:
        return {"status": "failed", "detail": f"the child exited {child.returncode} without a result"}
    return json.loads(lines[-1])


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"# Overlap probe: {args.target} verification ({args.verify_rows} rows) beside {args.draft_steps} "
             f"{args.draft} draft steps, two streams of one process", "",
             f"Status: **{result['status']}**" + (f" ({result['detail']})" if result.get("detail") else "") + ".", ""]
    if result["status"] == "ok":
        lines += [f"Device: {result['device']}. Random weights of real shapes; context {args.context}; medians of "
                  f"{args.reps} repeats (ms, CUDA events on the verification's stream).", "",
                  table(["verification alone", "beside the draft", "beside / alone", "draft step alone"],
                        [[fmt(result["verify_alone_ms"], ".3f"), fmt(result["verify_beside_ms"], ".3f"),
                          fmt(result["beside_over_alone"], ".2f"), fmt(result["draft_step_ms"], ".3f")]]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)), flush=True)
        return 0
    result = watched(argv, args.watchdog_s)
    text = report(result, args)
    print(text)
    write_results(args.out, args.name, {"benchmark": "gpu_overlap", "settings": vars(args) | {"out": str(args.out)},
                                        **result}, text)
    return 0 if result["status"] in ("ok", "skipped") else 1


# -- the measurement (the child; CUDA only) ---------------------------------------------------------------

def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    if not torch.cuda.is_available():
        return {"status": "skipped", "detail": "no CUDA device"}
    import faulthandler
    faulthandler.dump_traceback_later(max(1.0, args.watchdog_s - 2), exit=False)  # where it hung, in the log
    verify = _replayable(args.target, args.verify_rows, args, seed=0)
    draft = _replayable(args.draft, 1, args, seed=1)
    verify_stream, draft_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(beside: bool, replay=verify, stream=verify_stream) -> float:
        if beside:
            with torch.cuda.stream(draft_stream):
                for _ in range(args.draft_steps):
                    draft()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            replay()
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    for _ in range(3):  # warm-up
        timed(True)
    alone = statistics.median(timed(False) for _ in range(args.reps))
    beside = statistics.median(timed(True) for _ in range(args.reps))
    draft_ms = statistics.median(timed(False, draft, draft_stream) for _ in range(args.reps))
    log(f"verification alone {alone:.3f} ms, beside the draft {beside:.3f} ms")
    return {"status": "ok", "device": torch.cuda.get_device_name(0), "verify_alone_ms": alone,
            "verify_beside_ms": beside, "beside_over_alone": beside / alone, "draft_step_ms": draft_ms}


def _replayable(shape: str, rows: int, args: argparse.Namespace, seed: int):
    """A runner of a random ``shape`` model with its graphs captured at start-up (its own capture stream), a
    ``--context`` prefix prefilled, and one ``rows``-row pass staged: returns that pass's graph replay."""
    from benchmarks.synthetic import prompts, random_model
    from saguaro.backends.paged.graphs import bucket_for
    from saguaro.engine.model_runner import ForwardItem, ModelRunner
    loaded = random_model(shape, "cuda:0", seed=seed)
    runner = ModelRunner(loaded.model, 2 * (args.context + 64) // 16 + 8, 16, "cuda:0", enforce_eager=False,
                         max_seq_len=2 * args.context)
    runner.capture_graphs(rows)
    table_: list[int] = []
    runner.blocks.reserve(table_, args.context + rows)
    runner.forward([ForwardItem(prompts(loaded.config.vocab_size, 1, args.context)[0], 0, table_, "none")])
    runner.forward([ForwardItem(list(range(1, rows + 1)), args.context, table_, "all")])  # stages the pass
    graph = runner.backend.graphs.graphs[(bucket_for(rows), 0)]

    def replay(keep=(runner, loaded)) -> None:  # the graph reads them by address: they live as long as the replay
        graph.replay()
    return replay


if __name__ == "__main__":
    raise SystemExit(main())
