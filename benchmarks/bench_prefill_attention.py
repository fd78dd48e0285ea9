"""Prefill attention on the CPU kernels, and a long prompt's prefill rate through the engine.

Kernel rows: one attention call of a prefill chunk (``--new`` queries after ``--cached`` tokens, SmolLM2-135M's
heads: 9 query heads over 3 kv heads of 64) on every kernel tier this CPU executes, given as one group and as
groups of 15 queries, each over the context it sees (the same kernel, and the same bits: one group shares each
block of keys among more queries). Engine rows: the prefill of a ``--prompt-tokens`` prompt of SmolLM2-135M
(bf16, the CPU kernels) in one pass, tokens per second.

    python -m benchmarks.bench_prefill_attention                      # 512 new after 3584 cached, 2048-token prompt
    python -m benchmarks.bench_prefill_attention --new 64 --cached 192 --prompt-tokens 0 --out /tmp/x   # smoke
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import write_results
from saguaro.backends.cpu_kernels import build as kernels
from saguaro.kv.metadata import build_metadata

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _call(ops, groups, q, k_cache, v_cache) -> float:
    meta = build_metadata([c for c, _ in groups], [m.shape[0] for _, m in groups], [m for _, m in groups])
    qkv = torch.cat((q.view(q.shape[0], -1), torch.zeros(q.shape[0], 2 * KV_HEADS * HEAD_DIM, dtype=q.dtype)), 1)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ops.attention(qkv, k_cache, v_cache, meta.query_index, meta.query_valid, meta.context_slots, meta.mask,
                      HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_rows(new: int, cached: int) -> list[dict]:
    torch.manual_seed(0)
    total = cached + new
    k_cache, v_cache = torch.randn(2, total, KV_HEADS, HEAD_DIM).bfloat16()
    q = torch.randn(new, HEADS, HEAD_DIM).bfloat16()
    slots = list(range(total))
    whole = [(slots, torch.ones(new, total, dtype=torch.bool).tril(cached))]
    split = [(slots[:cached + min(i + 15, new)], torch.ones(min(15, new - i), cached + min(i + 15, new),
                                                           dtype=torch.bool).tril(cached + i))
             for i in range(0, new, 15)]
    rows = []
    for tier in kernels.runnable_tiers():
        ops = kernels.load(tier)
        groups, one = _call(ops, split, q, k_cache, v_cache), _call(ops, whole, q, k_cache, v_cache)
        rows.append({"tier": tier, "groups_of_15_ms": 1e3 * groups, "one_group_ms": 1e3 * one,
                     "speedup": groups / one})
        print(rows[-1], flush=True)
    return rows


def engine_prefill(prompt_tokens: int) -> dict:
    from saguaro import LLM, SamplingParams
    with LLM("smollm2-135m", max_prefill_tokens=prompt_tokens, max_model_len=prompt_tokens + 64) as llm:
        ids = [(7 * i + 11) % 40000 + 100 for i in range(prompt_tokens)]
        llm.generate([ids[:64]], SamplingParams(max_tokens=1))  # warm
        start = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1))
        took = time.perf_counter() - start
    return {"prompt_tokens": prompt_tokens, "prefill_s": took, "tokens_per_s": prompt_tokens / took}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--cached", type=int, default=3584)
    p.add_argument("--prompt-tokens", type=int, default=2048, help="0: no engine row")
    p.add_argument("--cpu", default="AMD EPYC Zen 4, 2 cores, AVX512-BF16", help="the CPU named beside the figures")
    p.add_argument("--out", default="results/prefill_attention")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = kernel_rows(args.new, args.cached)
    engine = engine_prefill(args.prompt_tokens) if args.prompt_tokens else None
    setup = (f"attention of {args.new} new tokens after {args.cached} cached ({HEADS} heads over {KV_HEADS} kv heads "
             f"of {HEAD_DIM}), 1 thread; CPU: {args.cpu} ({platform.machine()})")
    lines = [f"# Prefill attention on the CPU kernels\n\n{setup}\n",
             "| tier | groups of 15 (ms) | one group (ms) | speedup |", "|---|---|---|---|"]
    lines += [f"| {r['tier']} | {r['groups_of_15_ms']:.1f} | {r['one_group_ms']:.1f} | {r['speedup']:.2f}x |"
              for r in rows]
    if engine:
        lines.append(f"\nSmolLM2-135M (bf16), a {engine['prompt_tokens']}-token prompt prefilled in one pass: "
                     f"{engine['prefill_s']:.2f} s, {engine['tokens_per_s']:.0f} tok/s")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out)  # a prefix: OUT.json and OUT.md
    write_results(out.parent, out.name, {"setup": setup, "kernels": rows, "engine": engine}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
