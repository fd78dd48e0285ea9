"""Inter-token latency of running streams while one long prompt arrives: chunks of a fixed size, chunks
sized by time ("auto"), or none.

A few streams decode; then one long prompt (random token ids) arrives. Without chunking its whole
prefill is one engine step, and every running stream waits for it; with chunks of
``max_prefill_tokens``, prefill chunks alternate with decode rounds, so a running stream waits at
most one chunk per token; with "auto" a chunk is as many tokens as fit the step budget
(``--budget``, default the device's), so that wait is about the budget however long the prompt.
The engine loop is driven directly (as the server's loop thread drives it) so the figures hold no
HTTP noise. Inter-token latency (ITL) is the time between two tokens of one running stream, over
every stream, from the long prompt's arrival to its first token; the long prompt's time to first
token is reported beside it.

``--mode ssd --draft NAME`` runs the streams with SSD: the speculator prefills the long prompt too
(in pieces, in its idle time), and the row also reports the streams' cache hit rate over the window
(a build cut short shows there). ``--label`` names the code measured and ``--append`` adds the rows to
an existing output, so two builds of the engine share one table.

    python -m benchmarks.bench_serving_itl                  # SmolLM2-135M, 8k-token prompt, 2 streams: 4096 vs auto
    python -m benchmarks.bench_serving_itl --prompt-tokens 1024 --chunks 0,128,auto --dtype float32
    python -m benchmarks.bench_serving_itl --prompt-tokens 256 --streams 2 --chunks 0,64 --out /tmp/x   # smoke
    python -m benchmarks.bench_serving_itl --mode ssd --draft smollm2-135m --prompt-tokens 2048 --chunks auto \
        --out results/serving_itl_ssd_prefill
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import write_results
from saguaro import LLM, SamplingParams


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _start_streams(engine, streams: int, vocab: int, rng: random.Random) -> list:
    """``streams`` requests of 16 random tokens that decode until aborted, each past its first token."""
    seqs = [engine.add_request([rng.randrange(vocab) for _ in range(16)],
                               SamplingParams(max_tokens=100_000, ignore_eos=True)) for _ in range(streams)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    return seqs


def run_one(llm: LLM, streams: int, prompt_tokens: int, vocab: int) -> dict:
    """One measurement on a warm engine: ``streams`` decoding, then the long prompt; times in seconds."""
    engine = llm.engine
    rng = random.Random(0)
    running = _start_streams(engine, streams, vocab, rng)
    for _ in range(3):
        engine.step()
    last = {s.seq_id: time.perf_counter() for s in running}
    trace = getattr(engine.decoder, "trace", [])  # SSD's rounds: cache hits and build steps
    rounds_before = len(trace)
    long = engine.add_request([rng.randrange(vocab) for _ in range(prompt_tokens)],
                              SamplingParams(max_tokens=1, ignore_eos=True))
    arrival, gaps, ttft, chunks = time.perf_counter(), [], None, []
    after = set()  # streams with a token since the long prompt's first: the window closes when all have one
    while len(after) < streams:
        cached = long.num_cached
        events = engine.step()
        if long.num_cached > cached:
            chunks.append(long.num_cached - cached)
        for seq, tokens in events:
            now = time.perf_counter()
            if seq is long:
                ttft = now - arrival if tokens else None  # a chunk that completes no prompt gives no token
            elif tokens:
                gaps.append(now - last[seq.seq_id])
                last[seq.seq_id] = now
                if ttft is not None:
                    after.add(seq.seq_id)
    for s in running:
        engine.abort(s)
    window = trace[rounds_before:]
    hits = [h for t in window for h in t.hits]
    return {"itl_p50_ms": 1e3 * _percentile(gaps, 0.5), "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
            "itl_max_ms": 1e3 * max(gaps), "long_ttft_s": ttft, "gaps": len(gaps), "chunk_tokens": chunks,
            "hit_rate": sum(hits) / len(hits) if hits else None,
            "build_steps_mean": statistics.mean(t.build_steps for t in window) if window else None}


def steady_itl(llm: LLM, streams: int, vocab: int, steps: int = 20) -> float:
    """Median ITL of the streams with nothing arriving (ms)."""
    engine = llm.engine
    seqs = _start_streams(engine, streams, vocab, random.Random(1))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for s in seqs:
        engine.abort(s)
    return 1e3 * statistics.median(times)


def _table(setup: str, rows: list[dict]) -> str:
    lines = [f"# Inter-token latency while a long prompt arrives\n\n{setup}\n",
             "| code | mode | max_prefill_tokens | chunk tokens | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) "
             "| steady ITL (ms) | long prompt TTFT (s) | SSD hit rate | build steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hit = "" if r.get("hit_rate") is None else f"{r['hit_rate']:.2f}"
        steps = "" if r.get("build_steps_mean") is None else f"{r['build_steps_mean']:.2f}"
        lines.append(f"| {r.get('label', '')} | {r.get('mode', 'ar')} | {r['chunk']} | {r['chunk_tokens']} "
                     f"| {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['itl_max_ms']:.1f} "
                     f"| {r['steady_itl_ms']:.1f} | {r['long_ttft_s']:.2f} | {hit} | {steps} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--mode", default="ar", choices=["ar", "sd", "ssd"])
    p.add_argument("--draft", default=None, help="the draft of sd/ssd (default: the engine's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--chunks", default="4096,auto",
                   help="max_prefill_tokens to compare; 0: the whole prompt (none); auto: sized by time")
    p.add_argument("--budget", type=float, default=None, help="auto's step budget in seconds (default: the device's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu", default="AMD EPYC Zen 4, 2 cores, AVX512-BF16", help="the CPU named beside the figures")
    p.add_argument("--label", default="", help="names the code measured in the table's first column")
    p.add_argument("--append", action="store_true", help="add the rows to those already in --out")
    p.add_argument("--out", default="results/serving_itl")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = dict(mode=args.mode, draft=args.draft) if args.mode != "ar" else {}
    rows = []
    for chunk in [c if c == "auto" else int(c) for c in args.chunks.split(",")]:
        timed = dict(prefill_step_budget_s=args.budget) if chunk == "auto" else {}
        with LLM(args.model, dtype=args.dtype, threads=args.threads, max_prefill_tokens=chunk or args.prompt_tokens,
                 max_model_len=args.prompt_tokens + 256, kv_cache_tokens=args.prompt_tokens + 4096, **spec,
                 **timed) as llm:
            vocab = llm.engine.target.config.vocab_size
            run_one(llm, args.streams, min(256, args.prompt_tokens), vocab)  # warm-up
            row = run_one(llm, args.streams, args.prompt_tokens, vocab)
            row["steady_itl_ms"] = steady_itl(llm, args.streams, vocab)
        budget = getattr(llm.engine.scheduler.chunks, "budget_s", None)
        row["chunk"] = "none (whole prompt)" if chunk == 0 else f"auto ({budget:g} s)" if chunk == "auto" else chunk
        row["chunk_tokens"] = (f"{min(row['chunk_tokens'])}-{max(row['chunk_tokens'])} "
                               f"({len(row['chunk_tokens'])} chunks)")
        row["label"] = args.label
        row["mode"] = args.mode if args.mode == "ar" else f"{args.mode} ({args.draft or 'default draft'})"
        rows.append(row)
        print(row, flush=True)
    setup = (f"{args.model} ({args.dtype}, {args.threads} thread), {args.streams} running streams, one prompt of "
             f"{args.prompt_tokens} random tokens arriving; CPU: {args.cpu} ({platform.machine()})")
    out = Path(args.out)  # a prefix: OUT.json and OUT.md
    if args.append and out.with_suffix(".json").exists():
        rows = json.loads(out.with_suffix(".json").read_text())["rows"] + rows
    table = _table(setup, rows)
    print(table)
    write_results(out.parent, out.name, {"setup": setup, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
