"""``saguaro demo``: SSD against SD and AR on the default real pair (or ``--target`` / ``--draft``), side by side.

Target Qwen2.5-Coder-1.5B-Instruct in bf16, draft Qwen2.5-Coder-0.5B-Instruct (by default
run with int4 weights and a 65,536-token head: the same cheap draft for SD and SSD, still
lossless).
AR and SD run on one core (the draft collocated with the target, as in the paper's SD
baseline); SSD adds the draft's own core. Same prompts, greedy, one run; ratios from this run.
"""
from __future__ import annotations

import argparse
import statistics
import time

from saguaro import LLM, SamplingParams
from saguaro import datasets

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    outs = [llm.generate([p], SamplingParams(max_tokens=max_tokens))[0] for p in prompts]  # batch 1: latency
    metrics = llm.spec_metrics(outs)
    return {
        "tok_s": statistics.median(o.timings.decode_tokens_per_s for o in outs),
        "acceptance": None if metrics is None else metrics.acceptance_rate,
        "tokens_per_round": None if metrics is None else metrics.tokens_per_round,
        "p_hit": None if metrics is None else metrics.cache_hit_rate,
        "tokens": [o.token_ids for o in outs],
        "text": outs[0].text,
        "failure": getattr(llm.engine.decoder, "failure", None),  # SSD: why it fell back to n-gram SD
    }


def run_demo(args: argparse.Namespace) -> int:
    common = dict(dtype="bfloat16", enforce_eager=args.enforce_eager, max_model_len=4096, kv_cache_tokens=8192)
    draft_fmt = dict(draft_weights=args.draft_weights, draft_vocab=args.draft_vocab or None)
    target, draft = args.target, args.draft
    print(f"Loading {target} (target, bf16) and {draft} (draft, {args.draft_weights}) ...", flush=True)
    t0 = time.perf_counter()
    with LLM(target, **common) as ar:
        prompts = datasets.as_chat(ar.tokenizer, [f"Complete this Python function:\n\n{p}"
                                                  for p in datasets.humaneval(args.prompts)])
        print(f"loaded in {time.perf_counter() - t0:.1f} s; {len(prompts)} HumanEval prompts, "
              f"{args.max_tokens} new tokens each, greedy\n", flush=True)
        results = {"AR (1 core)": _run(ar, prompts, args.max_tokens)}
    with LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=args.k, **common, **draft_fmt) as sd:
        results[f"SD K<={args.k} adaptive (1 core)"] = _run(sd, prompts, args.max_tokens)
    # SSD's tree is built while one verification runs: the glue, then a few steps over all branches, then
    # narrow steps that take the likeliest branch on to K tokens (benchmarks/bench_ssd.py --fan-outs 'F@S').
    ssd_k, fan_out = len(args.ssd_fan_out) - 1, args.ssd_fan_out
    with LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=ssd_k, fan_out=fan_out, **common,
             branch_steps=args.ssd_branch_steps or None, **draft_fmt) as ssd:
        results[f"SSD K<={ssd_k} adaptive (2 cores)"] = _run(ssd, prompts, args.max_tokens)
    ar_speed = results["AR (1 core)"]["tok_s"]
    sd_speed = results[f"SD K<={args.k} adaptive (1 core)"]["tok_s"]
    print(f"{'mode':30s} {'tok/s':>7s} {'xAR':>6s} {'xSD':>6s} {'accept':>7s} {'tok/rnd':>8s} {'p_hit':>6s}")
    for name, r in results.items():
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        name += " FAILED" if r["failure"] else ""
        print(f"{name:30s} {r['tok_s']:7.2f} {r['tok_s'] / ar_speed:6.2f} {r['tok_s'] / sd_speed:6.2f} "
              f"{fmt(r['acceptance'], '.3f'):>7s} {fmt(r['tokens_per_round'], '.2f'):>8s} {fmt(r['p_hit'], '.2f'):>6s}")
    reference = results["AR (1 core)"]["tokens"]
    same = {name: r["tokens"] == reference for name, r in results.items()}
    print("\nSD and SSD choose each request's K every round, from 0 (a plain AR step) up to K, from its acceptance"
          " so far and the measured pass costs.")
    print("Greedy outputs identical to AR: " + ", ".join(f"{n}: {'yes' if v else 'no'}" for n, v in same.items()))
    print("(bf16: a verification pass over K+1 rows may round an argmax tie differently from a 1-row pass;"
          " exactness is tested in fp32.)")
    print("\nSSD output for the first prompt:\n" + results[f"SSD K<={ssd_k} adaptive (2 cores)"]["text"])
    failure = results[f"SSD K<={ssd_k} adaptive (2 cores)"]["failure"]
    if failure:  # its figures are n-gram SD's: say so last, where it is read, and fail the command
        print(f"\nSSD fell back to n-gram SD: {failure}")
        return 1
    return 0
