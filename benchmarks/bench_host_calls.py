"""The decode loop's host work per generated token for a request that asks for no option (greedy, no penalties,
no logprobs, no grammar): Python calls and torch calls counted per decode step, and wall time per token.

Rows: AR, SD and SSD (the speculator in a thread of this process), adaptive K (the default) and, with
``--fixed-k``, SD and SSD at a fixed K as well, at each batch size. The counts come from one run under
``cProfile`` and a torch-function counter (``build_counters.TorchCalls``) in the engine's thread, prefill steps
left out; they are deterministic for a fixed K and vary a little with adaptive K (its choices follow
timings). The wall time is the median over ``--reps`` runs without counting (on a shared machine, a loaded one:
compare rows of one run).

    saguaro bench host_calls --target smollm2-135m --draft smollm2-135m --batch 1,4
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_peers import cpu_description
from benchmarks.build_counters import TorchCalls
from benchmarks.common import (add_model_args, environment, fmt, int_list, log, median, settings, str_list, table,
                               write_results)
from saguaro import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the desert.",
           "List three prime numbers:"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench host_calls", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--modes", type=str_list, default=["ar", "sd", "ssd"], help="modes (default ar,sd,ssd)")
    p.add_argument("--batch", type=int_list, default=[1], help="batch sizes, comma separated (default 1)")
    p.add_argument("--k", type=int, default=3, help="K of SD and SSD (the adaptive rows' largest; default 3)")
    p.add_argument("--fixed-k", action="store_true", help="also SD and SSD at a fixed K (adaptive=False)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per row, the median reported (default 3)")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory of bench_host_calls.json/.md")
    args = p.parse_args(argv)
    if any(m not in ("ar", "sd", "ssd") for m in args.modes) or args.k < 1 or args.reps < 1:
        p.error("--modes takes ar, sd and ssd; --k and --reps must be >= 1")
    return args


def configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(row name, LLM options) per mode: adaptive K, and fixed K with ``--fixed-k``."""
    base = dict(max_prefill_tokens=4096)
    spec = dict(base, draft=args.draft, num_speculative_tokens=args.k)
    out = []
    for mode in args.modes:
        if mode == "ar":
            out.append(("AR", dict(base)))
            continue
        options = dict(spec, mode=mode, **({"speculator_transport": "thread"} if mode == "ssd" else {}))
        out.append((f"{mode.upper()} adaptive K<={args.k}", options))
        if args.fixed_k:
            out.append((f"{mode.upper()} K={args.k}", dict(options, adaptive=False)))
    return out


def counted(llm: LLM, prompts: list[str], params: SamplingParams) -> dict[str, float]:
    """Python calls (functions and builtins), torch calls and steps of the decode steps of one generation, per
    generated token."""
    engine = llm.engine
    real_step, real_prefill = engine.step, engine._prefill
    totals = dict(python=0, torch=0, tokens=0, steps=0)
    prefilled = [False]

    def prefill(*a, **kw):
        prefilled[0] = True
        return real_prefill(*a, **kw)

    def step():
        prefilled[0] = False
        profile, calls = cProfile.Profile(), TorchCalls()
        with calls:
            profile.enable()
            try:
                events = real_step()
            finally:
                profile.disable()
        if not prefilled[0]:
            totals["python"] += pstats.Stats(profile).total_calls - 1  # less the profiler's own disable()
            totals["torch"] += calls.count
            totals["tokens"] += sum(len(gained) for _, gained in events)
            totals["steps"] += 1
        return events

    engine.step, engine._prefill = step, prefill
    try:
        llm.generate(prompts, params)
    finally:
        engine.step, engine._prefill = real_step, real_prefill
    tokens = max(totals["tokens"], 1)
    return dict(python_calls_per_token=totals["python"] / tokens, torch_calls_per_token=totals["torch"] / tokens,
                tokens_per_step=totals["tokens"] / max(totals["steps"], 1))


def run_row(name: str, options: dict[str, Any], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(target=args.target, **options) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        counts = counted(llm, prompts, params)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append((time.perf_counter() - t0) / sum(len(o.token_ids) for o in outputs))
    log(f"{name} batch {batch}: {counts['python_calls_per_token']:.0f} Python, "
        f"{counts['torch_calls_per_token']:.0f} torch calls per token")
    counts["tokens_per_step"] /= batch  # per request: a round's tokens
    return dict(config=name, batch=batch, **counts, us_per_token=median(times) * 1e6)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [run_row(name, options, b, args) for b in args.batch for name, options in configs(args)]
    headers = ["config", "batch", "Python calls/token", "torch calls/token", "tokens/round", "us/token"]
    body = [[r["config"], r["batch"], fmt(r["python_calls_per_token"], ".0f"), fmt(r["torch_calls_per_token"], ".0f"),
             fmt(r["tokens_per_step"]), fmt(r["us_per_token"], ".0f")] for r in rows]
    env = dict(environment(), cpu=cpu_description())
    markdown = (f"# Host work per token, options off ({args.target} / {args.draft})\n\n{table(headers, body)}\n\n"
                f"CPU: {env['cpu']['summary']}; load average {env['loadavg']}.\n")
    print(markdown)
    payload = {"settings": settings(args), "environment": env, "rows": rows}
    write_results(args.out, "bench_host_calls", payload, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
