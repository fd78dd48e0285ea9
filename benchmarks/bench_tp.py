"""Tensor parallelism on this machine: TP=1 against TP=2 for AR, SD and SSD.

Per configuration: decode tok/s (median over prompts, greedy), each rank's weights (its shard's
parameter bytes) and resident memory after the run, and on rank 0 the time spent in collectives
(the model's all-reduces and logits gather, plus the step broadcast) per target pass.

Every rank runs the eager reference in fp32 (the tensor-parallel path is eager only). Rank r is
pinned to core r; the SSD speculator to core 1 as well, so SSD at TP=2 puts three processes on two
cores. On 2 cores that share one memory bus, TP cannot be faster: each rank streams half the weights
but the bus is shared and every layer waits for two all-reduces. The numbers show that cost.

    python -m benchmarks.bench_tp                    # defaults: 1 HumanEval prompt, 16 tokens (several minutes)
    saguaro bench tp --modes ar --max-tokens 8       # smoke test
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
from pathlib import Path
from typing import Any

from benchmarks.common import (environment, fmt, log, median, prepare_prompts, run_requests, settings, str_list,
                               table, write_results)
from saguaro.host_memory import resident_bytes
from saguaro.loading import load_tokenizer

YES_NO = {True: "yes", False: "no", None: "-"}
CPU = "AMD EPYC Zen 3, 2 cores, AVX2" if "AMD EPYC" in open("/proc/cpuinfo").read() else platform.processor()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench tp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-0.5b", help="target model (default qwen2.5-coder-0.5b)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b",
                   help="SSD draft (default the target itself: a stand-in that measures the cost, not a speed-up)")
    p.add_argument("--modes", type=str_list, default=["ar", "sd", "ssd"], help="ar, sd (n-gram proposer), ssd")
    p.add_argument("--sizes", type=str_list, default=["1", "2"], help="tensor-parallel sizes (default 1,2)")
    p.add_argument("--prompts", type=int, default=1, help="HumanEval prompts (default 1)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default 16)")
    p.add_argument("--k", type=int, default=4, help="SD / SSD lookahead (default 4)")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for bench_tp.json and .md")
    return p.parse_args(argv)


def rss_mb(pid: int) -> float | None:
    rss = resident_bytes(pid)
    return rss / 2**20 if rss else None


def options(mode: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = dict(mode=mode, dtype="float32", tensor_parallel_size=size, target_cores=[0],
                                draft_cores=[1], max_model_len=2048, kv_cache_tokens=4096)
    if mode == "sd":
        opts.update(proposer="ngram", num_speculative_tokens=args.k)
    if mode == "ssd":
        opts.update(draft=args.draft, num_speculative_tokens=args.k, speculator_transport="process")
    return opts


def run(mode: str, size: int, prompts, args: argparse.Namespace) -> dict[str, Any]:
    from saguaro import LLM
    log(f"{mode} TP={size}: loading")
    with LLM(args.target, **options(mode, size, args)) as llm:
        records = run_requests(llm, f"{mode}-tp{size}", prompts, [0.0], args.max_tokens, 0)
        weights = sum(p.numel() * p.element_size() for p in llm.target.model.parameters())
        ranks = [os.getpid()] + [w.pid for w in llm._target.workers]
        backend = llm.engine.target.backend
        clock = getattr(getattr(backend, "link", None), "groups", None)
        per_pass = clock.clock.seconds / backend.passes * 1e3 if clock and backend.passes else None
        row = dict(mode=mode, tp=size, tok_s=median(r.tok_s for r in records), weights_mb_per_rank=weights / 2**20,
                   rss_mb_per_rank=[rss_mb(pid) for pid in ranks], collective_ms_per_pass=per_pass,
                   passes=getattr(backend, "passes", None), tokens=[r.token_ids for r in records])
    gc.collect()
    log(f"  {row['tok_s']:.2f} tok/s, weights {row['weights_mb_per_rank']:.0f} MB per rank")
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = prepare_prompts(load_tokenizer(args.target), ["humaneval"], args.prompts)
    rows = [run(mode, int(size), prompts, args) for mode in args.modes for size in args.sizes]
    base = {r["mode"]: r for r in rows if r["tp"] == 1}
    for r in rows:
        same = base.get(r["mode"])
        r["same_tokens_as_tp1"] = None if same is None else r["tokens"] == same["tokens"]
    md = table(["mode", "TP", "decode tok/s", "vs TP=1", "weights MB / rank", "RSS MB per rank",
                "collectives ms / pass", "same tokens"],
               [[r["mode"], r["tp"], fmt(r["tok_s"]),
                 fmt(r["tok_s"] / base[r["mode"]]["tok_s"] if r["mode"] in base else None) + "x",
                 fmt(r["weights_mb_per_rank"], ".0f"), " / ".join(fmt(m, ".0f") for m in r["rss_mb_per_rank"]),
                 fmt(r["collective_ms_per_pass"]), YES_NO[r["same_tokens_as_tp1"]]] for r in rows])
    header = (f"Tensor parallelism, {CPU}; target {args.target} fp32 (eager), greedy, {args.prompts} HumanEval "
              f"prompt(s) x {args.max_tokens} tokens; SD: n-gram proposer K={args.k}; SSD: draft {args.draft}.\n"
              "CPU only (Gloo); each rank pinned to its own core.\n\n")
    print(header + md)
    write_results(args.out, "bench_tp", {"cpu": CPU, "environment": environment(), "settings": settings(args),
                                         "rows": rows}, header + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
