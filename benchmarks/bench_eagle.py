"""An EAGLE-3 head against the 0.5B draft model in SD and SSD, on the demo target and held-out HumanEval prompts.

Target Qwen2.5-Coder-1.5B-Instruct (bf16, one core, one thread, batch 1). Drafts: Qwen2.5-Coder-0.5B-Instruct
(bf16) and an EAGLE-3 head trained by ``saguaro train-head`` (its directory: --head). HumanEval's first items
are the prompts; the trainer never reads them. Every configuration runs the same prompts in this one run.
A target with an EAGLE-3 draft runs the eager backend (the head reads layers the eager path keeps); on a CPU
without AVX512-BF16 every configuration runs eager anyway. The SSD rows run the draft on a second core (fan-out 1
per depth, 2 at depth K); what moving the head's target features costs there is ``benchmarks.eagle_transport``'s.

    python -m benchmarks.bench_eagle                       # defaults: 3 prompts, 48 tokens, K=3, T in 0,1
    saguaro bench eagle --prompts 1 --max-tokens 8          # smoke test
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import (ALL, DRAFT, add_common_args, dataset_labels, engine_options, environment, fmt,
                               group_records, log, prepare_prompts, ratio, run_engine, same_tokens, settings, table,
                               write_results)
from saguaro.loading.paths import cache_root

AR = "AR"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench eagle", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, prompts=3, max_tokens=48, datasets="humaneval")
    p.add_argument("--k", type=int, default=3, help="drafts per round for both drafts (default 3)")
    p.add_argument("--no-ssd", action="store_true", help="only AR and SD (SSD adds a second core's draft)")
    p.add_argument("--head", type=Path,
                   help="the EAGLE-3 head directory (default: where saguaro train-head saves it for --target)")
    args = p.parse_args(argv)
    args.head = args.head or cache_root() / "eagle" / Path(args.target).name / "head"
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    base = engine_options(args.enforce_eager, threads=1, target_cores=[0])
    name = "0.5B" if args.draft == DRAFT else Path(args.draft).name  # the draft model's row label
    ssd = dict(num_speculative_tokens=args.k, fan_out=[1] * args.k + [2], miss_strategy="jit")
    if not (args.head / "config.json").is_file():
        raise FileNotFoundError(f"no EAGLE-3 head at {args.head}: train one with "
                                f"saguaro train-head --target {args.target}")
    return [(AR, dict(base, mode="ar")),
            (f"SD {name} K={args.k}", dict(base, mode="sd", draft=args.draft, num_speculative_tokens=args.k)),
            (f"SD EAGLE-3 K={args.k}", dict(base, mode="sd", draft=str(args.head), draft_kind="eagle3",
                                             num_speculative_tokens=args.k))] + ([] if args.no_ssd else [
            # SSD: the draft on core 1, a fixed fan-out (no calibration profile needed), misses drafted just in time
            (f"SSD {name} K={args.k}", dict(base, mode="ssd", draft=args.draft, **ssd)),
            (f"SSD EAGLE-3 K={args.k}", dict(base, mode="ssd", draft=str(args.head), draft_kind="eagle3", **ssd))])


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX512-BF16 (which decides the bf16 fast path)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name}, {os.cpu_count()} cores, {'AVX512-BF16' if 'avx512_bf16' in info else 'AVX2, no AVX512-BF16'}"


def report(args, labels, summaries, records) -> tuple[dict[str, Any], str]:
    equal = {name: same_tokens(recs, records[AR]) for name, recs in records.items() if name != AR}
    lines = [f"# EAGLE-3 head vs {args.draft} draft in SD and SSD: {args.target} target, bf16, one core, one thread, "
             "batch 1", "",
             f"CPU: {cpu_name()}, load average {environment()['loadavg']}. {args.prompts} HumanEval prompts "
             f"(held out from the head's training), {args.max_tokens} new tokens, K={args.k}, head {args.head}.", "",
             "tok/s: decode tokens per second, median over prompts; xAR against our AR in this run. acc len: accepted "
             "drafts per round, pooled. draft ms: drafting per round, median (for a K-step round). =AR: greedy "
             "requests equal to AR (bf16 argmax ties may differ)."]
    for tk in summaries[AR]:
        rows = []
        for name, by_t in summaries.items():
            s = by_t.get(tk, {}).get(ALL)
            if not s:
                continue
            same = equal.get(name, (None, None))
            rows.append([name, fmt(s["tok_s_median"]), fmt(ratio(s["tok_s_median"],
                                                                  summaries[AR][tk][ALL]["tok_s_median"])),
                         fmt(s.get("acceptance_rate"), ".3f"), fmt(s.get("mean_accepted_length")),
                         fmt(s.get("draft_ms_median"), ".0f"), fmt(s.get("verify_ms_median"), ".0f"),
                         f"{same[0]}/{same[1]}" if same[1] and tk == "T=0" else "", s["requests"]])
        lines += ["", f"## {tk}", "", table(["config", "tok/s", "xAR", "accept", "acc len", "draft ms", "verify ms",
                                               "=AR", "n"], rows)]
    payload = {"benchmark": "eagle", "description": __doc__.split("\n\n")[0],
               "models": {"target": args.target, "draft": args.draft, "head": str(args.head), "dtype": "bfloat16"},
               "settings": settings(args), "environment": environment(), "datasets": labels, "summary": summaries,
               "greedy_equal_to_ar": {n: {"equal": a, "compared": b} for n, (a, b) in equal.items()},
               "requests": [r.to_json() for recs in records.values() for r in recs]}
    return payload, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from saguaro.loading import load_tokenizer
    prompts = prepare_prompts(load_tokenizer(args.target, progress=False), args.datasets, args.prompts)
    configs = plan(args)
    records = {name: run_engine(name, options, prompts, args) for name, options in configs}
    summaries = {name: group_records(recs) for name, recs in records.items()}
    payload, markdown = report(args, dataset_labels(args.datasets), summaries, records)
    print(markdown)
    json_path, md_path = write_results(args.out, "bench_eagle", payload, markdown)
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
