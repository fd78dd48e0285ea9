"""A bounded overlap probe: a verification graph on one stream while draft graphs replay on another.

SSD on one GPU gains only if the draft's build runs beside the target's verification. This probe measures
just that, with the engine's own graphs: a 1.5B-shape verification of ``--verify-rows`` rows and a 0.5B-shape
draft step (random weights of real shapes, ``benchmarks/synthetic.py``), each runner's graphs captured at its
start-up on its own capture stream. Per lane configuration -- stream priorities off or on (the verification's
stream first, as ``saguaro/ssd/stream_priority.py`` sets the engine's), and the draft on all SMs or in a green
context of ``--sms`` SMs (its graphs captured there, as the speculator thread's are) -- and per repeat:

* alone: the verification, then ``--draft-steps`` draft replays, each timed by CUDA events on its own stream;
* one after the other: the draft replays, then the verification ordered after them (host wall time to the end);
* together: the draft replays on one stream and the verification on the other, launched at once (wall time).

It reports each side's slowdown beside the other (beside / alone) and how much faster the two finish together
than one after the other, and saves its verdict -- the arrangement whose pair finishes soonest together, with the
figures that chose it, the card and torch's version -- as the profile a speculator thread on this card reads at
start-up (``saguaro/ssd/lane_profile.py``; ``--profile`` writes it elsewhere).

A run on two streams of one process once hung (``/work/shared/GPU.md``), so the measurement runs in a child
process under a watchdog: past ``--watchdog-s`` the child is killed and the probe reports "hung" instead of
hanging the GPU check; a configuration that raises is reported failed and the rest run. Without CUDA it reports
"skipped" and saves nothing. Everything but the child's measurement runs anywhere (``scripts/gpu_check.sh
--dry-run`` imports it).

    python -m benchmarks.gpu_overlap --watchdog-s 90 --out results
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, int_list, log, table, write_results
from saguaro.ssd.lane_profile import Arrangement, Candidate, LaneProfile, save_lane_profile, verdict

STATUSES = ("ok", "skipped", "hung", "failed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen2.5-1.5b", help="the verifying model's shape")
    p.add_argument("--draft", default="qwen2.5-0.5b", help="the draft's shape")
    p.add_argument("--verify-rows", type=int, default=5, help="rows of the verification (K+1, default 5)")
    p.add_argument("--draft-steps", type=int, default=4, help="draft replays launched beside each verification")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--priorities", type=_choices("off", "on"), default=["off", "on"],
                   help="stream priorities to measure, comma separated: off, on (default both)")
    p.add_argument("--sms", type=int_list, default=[16, 32, 66],
                   help="green-context SM counts for the draft, comma separated (default 16,32,66; all SMs always)")
    p.add_argument("--watchdog-s", type=float, default=90.0, help="kill the measurement after this long (default 90)")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--name", default="gpu_overlap")
    p.add_argument("--profile", type=Path, help="where to save the verdict (default: the cache's profile for the card, "
                                                "which the engine reads)")
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


def _choices(*allowed: str):
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out or any(x not in allowed for x in out):
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return out
    return parse


@dataclass(frozen=True)
class Lanes(Arrangement):
    """One configuration: stream priorities on or off, and the draft's SMs (None: all, no green context)."""

    @property
    def name(self) -> str:
        return f"priorities {'on' if self.priorities else 'off'}, draft on {self.sms or 'all'} SMs"


def configurations(args: argparse.Namespace) -> list[Lanes]:
    return [Lanes(p == "on", sms) for sms in [None, *args.sms] for p in args.priorities]


@dataclass
class LaneResult:
    """Medians over the repeats (ms); the ratios follow from them."""
    name: str
    verify_alone_ms: float | None = None
    draft_alone_ms: float | None = None  # the --draft-steps replays
    verify_beside_ms: float | None = None
    draft_beside_ms: float | None = None
    sequential_ms: float | None = None  # wall: the draft, then the verification
    together_ms: float | None = None  # wall: both at once
    error: str | None = None
    priorities: bool = True  # the arrangement measured
    sms: int | None = None
    together_spread: float | None = None  # (q3 - q1) / median of the together wall times

    @property
    def verify_slowdown(self) -> float | None:
        return _ratio(self.verify_beside_ms, self.verify_alone_ms)

    @property
    def draft_slowdown(self) -> float | None:
        return _ratio(self.draft_beside_ms, self.draft_alone_ms)

    @property
    def together_speedup(self) -> float | None:
        """How much faster both finish together than one after the other (> 1: the overlap pays)."""
        return _ratio(self.sequential_ms, self.together_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"verify_slowdown": self.verify_slowdown, "draft_slowdown": self.draft_slowdown,
                               "together_speedup": self.together_speedup}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def candidates(rows: list[dict[str, Any]]) -> list[Candidate]:
    """The measured rows as the profile weighs them (a failed one has no figure and is never chosen)."""
    return [Candidate(Arrangement(r.get("priorities", True), r.get("sms")), r.get("together_speedup") or 0.0,
                      r.get("verify_slowdown"), r.get("draft_slowdown"), r.get("together_spread")) for r in rows]


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row whose pair finishes soonest together, as ``lane_profile.verdict`` chooses (ties included)."""
    top = verdict(candidates(rows))
    return None if top is None else rows[candidates(rows).index(top)]


def lane_profile(result: dict[str, Any], args: argparse.Namespace) -> LaneProfile | None:
    """The verdict of a run that measured something, as the engine's profile; None where nothing was."""
    if result["status"] != "ok":
        return None
    weighed = candidates(result["configurations"])
    top = verdict(weighed)
    if top is None:
        return None
    keep = ("target", "draft", "verify_rows", "draft_steps", "context", "reps")
    return LaneProfile(result["device"], result["torch"], top, weighed,
                       settings={k: getattr(args, k) for k in keep})


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"# Overlap probe: {args.target} verification ({args.verify_rows} rows) beside {args.draft_steps} "
             f"{args.draft} draft steps, two streams of one process", "",
             f"Status: **{result['status']}**" + (f" ({result['detail']})" if result.get("detail") else "") + ".", ""]
    if result["status"] == "ok":
        rows = result["configurations"]
        lines += [f"Device: {result['device']}. Random weights of real shapes; context {args.context}; medians of "
                  f"{args.reps} repeats (ms; alone and beside by CUDA events on each side's stream, one after the "
                  f"other and together by host wall time to the end of both).", "",
                  table(["lanes", "verify alone", "verify beside", "verify slowdown", "draft alone", "draft beside",
                         "draft slowdown", "one after other", "together", "together speed-up"],
                        [[r["name"] + (f" FAILED: {r['error']}" if r["error"] else ""),
                          fmt(r["verify_alone_ms"], ".3f"), fmt(r["verify_beside_ms"], ".3f"),
                          fmt(r["verify_slowdown"], ".2f"), fmt(r["draft_alone_ms"], ".3f"),
                          fmt(r["draft_beside_ms"], ".3f"), fmt(r["draft_slowdown"], ".2f"),
                          fmt(r["sequential_ms"], ".3f"), fmt(r["together_ms"], ".3f"),
                          fmt(r["together_speedup"], ".2f")] for r in rows]), ""]
        top = best(rows)
        if top is not None:
            lines += [f"Best: {top['name']} ({fmt(top['together_speedup'], '.2f')}x faster together).", ""]
        if result.get("profile_path"):
            lines += [f"Saved as the engine's arrangement on this card: {result['profile_path']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)), flush=True)
        os._exit(0)  # no destructors: the green contexts' could abort the child after its result (GPU.md)
    result = watched(argv, args.watchdog_s)
    profile = lane_profile(result, args)
    if profile is not None:
        result["profile_path"] = str(save_lane_profile(profile, args.profile))
        result["verdict"] = profile.to_dict()
    text = report(result, args)
    print(text)
    write_results(args.out, args.name, {"benchmark": "gpu_overlap",
                                        "settings": vars(args) | {"out": str(args.out), "profile": str(args.profile)},
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
    rows, drafts = [], {}
    for lanes in configurations(args):
        result = LaneResult(lanes.name, priorities=lanes.priorities, sms=lanes.sms)
        try:
            _measure_lanes(lanes, verify, drafts, args, result)
        except Exception as e:  # noqa: BLE001 -- one configuration's failure (a green context refused) is reported
            result.error = f"{type(e).__name__}: {e}"
        log(f"{lanes.name}: {result.to_dict()}")
        rows.append(result.to_dict())
    return {"status": "ok", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "configurations": rows}


_GREENS: dict[int, Any] = {}


class _Lane:
    """A stream to launch on, of a priority, optionally in a green context (current only while launching)."""

    def __init__(self, priority: int | None, sms: int | None):
        import torch
        self.green = None
        if sms:  # one per SM count, kept: torch's GreenContext destructor can abort the process (GPU.md)
            from torch.cuda.green_contexts import GreenContext
            self.green = _GREENS.get(sms) or _GREENS.setdefault(sms, GreenContext.create(num_sms=sms, device_id=0))
        with self.on_context():
            self.stream = (self.green.Stream() if self.green is not None
                           else torch.cuda.Stream(priority=0 if priority is None else priority))

    @contextmanager
    def on_context(self):
        if self.green is None:
            yield
            return
        self.green.set_context()
        try:
            yield
        finally:
            self.green.pop_context()

    @contextmanager
    def on(self):
        import torch
        with self.on_context(), torch.cuda.stream(self.stream):
            yield


def _measure_lanes(lanes: Lanes, verify, drafts: dict, args: argparse.Namespace, out: LaneResult) -> None:
    """``drafts``: the draft's replay per SM count, captured in its lane (as the speculator thread's graphs are)
    the first time that SM count is measured."""
    import torch
    from saguaro.ssd.stream_priority import lane_priorities
    prio = lane_priorities("cuda:0", on=lanes.priorities)
    target = _Lane(prio.target if prio else None, None)
    side = _Lane(prio.speculator if prio else None, lanes.sms)
    if lanes.sms not in drafts:
        with side.on():
            drafts[lanes.sms] = _replayable(args.draft, 1, args, seed=1)
    draft = drafts[lanes.sms]

    def timed(lane: _Lane, replay, times: int) -> Any:
        with lane.on():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(times):
                replay()
            end.record()
        return start, end

    def rep(mode: str) -> tuple[float | None, float | None, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        v = d = None
        if mode in ("draft", "sequential", "together"):
            d = timed(side, draft, args.draft_steps)
        if mode == "sequential":  # the verification after the draft
            with side.on_context():
                done = torch.cuda.Event()
                done.record(side.stream)
            target.stream.wait_event(done)
        if mode in ("verify", "sequential", "together"):
            v = timed(target, verify, 1)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        return (v[0].elapsed_time(v[1]) if v else None), (d[0].elapsed_time(d[1]) if d else None), wall

    for mode in ("verify", "draft", "together"):  # warm-up
        rep(mode)
    runs = {mode: list(zip(*(rep(mode) for _ in range(args.reps))))
            for mode in ("verify", "draft", "sequential", "together")}
    med = {mode: [statistics.median(x) if None not in x else None for x in columns] for mode, columns in runs.items()}
    out.verify_alone_ms, out.draft_alone_ms = med["verify"][0], med["draft"][1]
    out.together_spread = _spread(list(runs["together"][2]))
    out.verify_beside_ms, out.draft_beside_ms, out.together_ms = med["together"]
    out.sequential_ms = med["sequential"][2]


def _spread(values: list[float]) -> float | None:
    """(q3 - q1) / median: how far the repeats scatter, relative to their median."""
    if len(values) < 2:
        return None
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / q2 if q2 else None


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
