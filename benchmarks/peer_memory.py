"""Resident memory and load time of Saguaro's configurations, the table ``saguaro bench peers --memory`` adds.

Each configuration runs twice in a fresh process: the first may convert the weights and stores the packed arena
(its load time is reported as the first load), the second loads from those caches, generates 8 greedy tokens
and reports its load time and the resident memory (RSS) of the engine's processes summed (SSD: the target's and
the speculator's). The KV cache holds 4,096 tokens, the context of llama.cpp's rows, so the figures compare with
llama.cpp's resident memory on the same model and context.

llama.cpp's rows (where ``bench peers`` runs llama.cpp): ``llama-completion`` on the 1.5B BF16 and Q4_K_M files,
the same prompt, 8 tokens, ``-c 4096``; its resident memory read by the same tool (``/proc/<pid>/statm``,
``host_memory.resident_bytes``) every 10 ms while it runs, the largest reading kept (the program exits once it has
generated, and it frees nothing before: the last readings are its memory after load plus 8 tokens); its load time
is its own "load time" line. Each Saguaro row's ratio is to the llama.cpp row of its weights (bf16: BF16, int4:
Q4_K_M), the issue's goal being at most 1.2x.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, table

CONTEXT = 4096  # llama.cpp's rows: -c 4096
TOKENS = 8
# (key, label, the LLM options beyond the shared ones; None: bench peers' SSD row; DRAFT: the draft alone, AR in
# the draft's weight format (its full head: the speculator may keep a reduced one)). {draft}: --draft-weights
DRAFT = "draft"
MEMORY_ROWS = (("mem-bf16", "AR, bf16 target", {}),
               ("mem-int8", "AR, int8 target", {"target_weights": "int8"}),
               ("mem-int4", "AR, int4 target", {"target_weights": "int4"}),
               ("mem-draft", "AR, the draft alone ({draft}, full head)", DRAFT),
               ("mem-ssd", "SSD, bf16 target + {draft} draft (2 processes)", None))
PAIR_OF = ("mem-ssd", "mem-bf16", "mem-draft")  # the SSD pair against its target's row plus its draft's
# llama.cpp's rows: (key, label, bench peers' model file key); and the llama.cpp row each Saguaro row compares with
LLAMA_MEMORY_ROWS = (("mem-llama-bf16", "llama.cpp, 1.5B BF16", "target-bf16"),
                     ("mem-llama-q4", "llama.cpp, 1.5B Q4_K_M", "target-q4"))
PEER_OF = {"mem-bf16": "mem-llama-bf16", "mem-int4": "mem-llama-q4"}
_LOAD_TIME = re.compile(r"\bload time =\s*([0-9]+(?:\.[0-9]+)?) ms")

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from saguaro import LLM, SamplingParams
from saguaro.backends.cpu_kernels import arena_cache
from benchmarks.peer_memory import tree_resident_bytes
spec = json.loads(sys.argv[1])
t1 = time.perf_counter()
with LLM(target=spec["target"], **spec["options"]) as llm:
    t2 = time.perf_counter()
    out = llm.generate([spec["prompt"]], SamplingParams(temperature=0.0, max_tokens=spec["tokens"]))
    arena_cache.wait_for_stores()  # the first run's background store, so the second maps the arena
    rss, processes = tree_resident_bytes()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_bytes": rss, "processes": processes,
                      "tokens": len(out[0].token_ids)}))
"""


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in task.read_text().split()]
        except (OSError, ValueError):
            pass
    return found


def tree_resident_bytes(pid: int | None = None) -> tuple[int, int]:
    """Resident bytes of a process and all its descendants summed, and how many processes that is."""
    from saguaro.host_memory import resident_bytes
    todo, seen = [pid or os.getpid()], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return sum(resident_bytes(p) for p in seen), len(seen)


def options_for(extra: dict[str, Any] | str | None, ssd: dict[str, Any]) -> dict[str, Any]:
    """A row's LLM options: bench peers' AR or SSD options with a KV cache of llama.cpp's context."""
    base = {k: v for k, v in ssd.items() if k not in ("mode", "draft", "num_speculative_tokens", "fan_out",
                                                      "branch_steps", "draft_weights", "draft_vocab",
                                                      "calibration_workload")}
    if extra is None:
        chosen = dict(ssd)
    elif extra == DRAFT:
        chosen = dict(base, mode="ar", target_weights=ssd.get("draft_weights", "bf16"))
    else:
        chosen = dict(base, mode="ar", **extra)
    return dict(chosen, max_model_len=CONTEXT, kv_cache_tokens=CONTEXT)


def run_probe(target: str, options: dict[str, Any], prompt: list[int], timeout: float) -> dict[str, Any]:
    spec = json.dumps({"target": target, "options": options, "prompt": prompt, "tokens": TOKENS})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE, spec], capture_output=True, text=True, timeout=timeout,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(target: str, ssd_options: dict[str, Any], prompt: list[int], timeout: float,
            log=print) -> dict[str, dict[str, Any]]:
    """Every memory row: the first load's time, then the cached load's time and resident memory."""
    results: dict[str, dict[str, Any]] = {}
    for key, label, extra in MEMORY_ROWS:
        options, label = options_for(extra, ssd_options), label.format(draft=ssd_options.get("draft_weights", "bf16"))
        model = ssd_options["draft"] if extra == DRAFT else target
        try:
            first = run_probe(model, options, prompt, timeout)
            cached = run_probe(model, options, prompt, timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"{key}: not measured: {e}")
            results[key] = {"label": label, "error": str(e)}
            continue
        results[key] = {"label": label, "first_load_s": first["load_s"], "load_s": cached["load_s"],
                        "import_s": cached["import_s"], "rss_gb": cached["rss_bytes"] / 1e9,
                        "processes": cached["processes"], "options": options, "model": model}
        log(f"  {key}: cached load {cached['load_s']:.2f} s, {cached['rss_bytes'] / 1e9:.2f} GB resident")
    return results


def sampled_run(cmd: list[str], timeout: float, cores: list[int] | None = None,
                interval_s: float = 0.01) -> tuple[str, int]:
    """(stdout and stderr, the largest resident memory read) of a program run to its end, its ``/proc/<pid>/statm``
    read every ``interval_s``. A failure or a hang raises RuntimeError."""
    from saguaro.host_memory import resident_bytes
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores and hasattr(os, "sched_setaffinity") else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=pin)
    largest, deadline = 0, time.monotonic() + timeout
    try:
        while proc.poll() is None:
            largest = max(largest, resident_bytes(proc.pid))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s")
            time.sleep(interval_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}): {output[-2000:]}")
    return output, largest


def measure_llama(commands: dict[str, list[str]], timeout: float, cores: list[int] | None = None,
                  log=print) -> dict[str, dict[str, Any]]:
    """llama.cpp's memory rows: ``commands`` maps each LLAMA_MEMORY_ROWS key to its llama-completion command."""
    results: dict[str, dict[str, Any]] = {}
    for key, label, _ in LLAMA_MEMORY_ROWS:
        if key not in commands:
            continue
        try:
            output, rss = sampled_run(commands[key], timeout, cores)
        except RuntimeError as e:
            log(f"{key}: not measured: {e}")
            results[key] = {"label": label, "error": str(e)}
            continue
        load = _LOAD_TIME.findall(output)
        results[key] = {"label": label, "rss_gb": rss / 1e9, "processes": 1,
                        "load_s": float(load[-1]) / 1e3 if load else None, "command": commands[key]}
        log(f"  {key}: {rss / 1e9:.2f} GB resident")
    return results


def memory_table(results: dict[str, dict[str, Any]]) -> str:
    def ratio(key: str) -> str:
        peer = results.get(PEER_OF.get(key, ""), {}).get("rss_gb")
        return fmt(results[key]["rss_gb"] / peer) if peer and results[key].get("rss_gb") else "-"

    lines = [[r["label"], fmt(r.get("rss_gb")), ratio(key), r.get("processes", "-"), fmt(r.get("first_load_s")),
              fmt(r.get("load_s")), fmt(r.get("import_s"))] for key, r in results.items()]
    pair, target, draft = (results.get(k, {}).get("rss_gb") for k in PAIR_OF)
    pair_line = (f"\n\nThe SSD pair against its target's row plus its draft's: {pair:.2f} GB / "
                 f"({target:.2f} + {draft:.2f}) GB = {pair / (target + draft):.2f}x." if pair and target and draft
                 else "")
    return ("Resident memory after loading and generating 8 tokens (RSS of the engine's processes summed), "
            f"a {CONTEXT}-token KV cache as llama.cpp's rows; load: `LLM(...)` in a fresh process, the first run "
            "(converting and packing, where nothing was cached yet) and the next, mapping the converted weights "
            "and the packed arena; "
            "import: `import saguaro` before it. llama.cpp: `llama-completion -c 4096 -n 8`, its resident memory "
            "read every 10 ms while it ran (the largest reading), its own load time line; x llama.cpp: against the "
            "llama.cpp row of the same weights (bf16: BF16, int4: Q4_K_M).\n\n"
            + table(["config", "resident GB", "x llama.cpp", "processes", "first run load s", "cached load s",
                     "import s"], lines) + pair_line)
