"""SD against AR on the Qwen pair: a K sweep, the n-gram speculator, and transformers' assisted generation.

Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct, bf16, one core (core 0),
one thread, batch 1, real HumanEval and MT-Bench prompts (chat template), greedy and seeded
temperature sampling. Every configuration runs the same prompts in this one run, so ratios
against our AR are taken from numbers measured together. The best K is the one with the
highest median tok/s over all prompts at each temperature. llama.cpp numbers are read from
the last ``saguaro bench peers`` (bench_peers.json in --out), not measured here.

The sweep (every K and the n-gram speculator) runs at the --sweep-at temperatures (default
greedy); at the other temperatures AR and the K that was best at the first sweep temperature
run. transformers runs at --hf-temperatures (default greedy).

    python -m benchmarks.bench_sd         # defaults: 2+2 prompts, 48 tokens, K in 2,4,6 (about 10-15 min eager)
    python -m benchmarks.bench_sd --prompts 3 --max-tokens 96 --ks 2,3,4,5,6,8 --sweep-at 0,1   # the full sweep
    saguaro bench sd --prompts 1 --max-tokens 8 --skip-hf                        # smoke test
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.common import (ALL, Record, add_common_args, dataset_labels,
                               draft_options, engine_options, environment, fmt, group_records, int_list, float_list,
                               log,
                               prepare_prompts, ratio, run_engine, same_tokens, settings, table, temp_key,
                               write_results)
from benchmarks.llama_cpp import measured_reference

AR = "AR"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench sd", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, max_tokens=48)
    p.add_argument("--ks", type=int_list, default=[2, 4, 6], help="draft lengths K to sweep (default 2,4,6)")
    p.add_argument("--ngram-k", type=int, default=4, help="K of the n-gram speculator run (0 skips it; default 4)")
    p.add_argument("--sweep-at", type=float_list, default=[0.0],
                   help="temperatures at which every K and the n-gram speculator run (default 0); elsewhere only "
                        "the best K of the first of them")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--hf-k", default="best",
                   help="K of transformers' assisted generation: 'best' (our measured best K, constant), an int, "
                        "or 'default' (transformers' own: 20 tokens with a 0.4 confidence cut-off)")
    p.add_argument("--hf-temperatures", type=float_list, default=None,
                   help="temperatures for the transformers runs (default: greedy only, 0)")
    args = p.parse_args(argv)
    if args.hf_temperatures is None:
        args.hf_temperatures = [0.0]
    return args


def sd_options(args: argparse.Namespace, k: int) -> dict[str, Any]:
    return dict(engine_options(args.enforce_eager, threads=1, target_cores=[0]), mode="sd", draft=args.draft,
                num_speculative_tokens=k, **draft_options(args))


def sweep_temperatures(args: argparse.Namespace) -> list[float]:
    return [t for t in args.temperatures if t in args.sweep_at] or args.temperatures


def plan(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], list[float]]]:
    """(name, LLM options, temperatures) of the engine configurations, AR first."""
    base = engine_options(args.enforce_eager, threads=1, target_cores=[0])
    sweep = sweep_temperatures(args)
    configs = [(AR, dict(base, mode="ar"), args.temperatures)]
    configs += [(f"SD K={k}", sd_options(args, k), sweep) for k in args.ks]
    if args.ngram_k:
        configs.append((f"SD n-gram K={args.ngram_k}",
                        dict(base, mode="sd", proposer="ngram", num_speculative_tokens=args.ngram_k), sweep))
    return configs


def best_k(summaries: dict[str, Any], ks: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per temperature and dataset group: the swept K with the highest median tok/s."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for tk, groups in summaries[AR].items():
        out[tk] = {}
        for group in groups:
            scored = [(summaries[f"SD K={k}"][tk][group]["tok_s_median"], k) for k in ks
                      if summaries.get(f"SD K={k}", {}).get(tk, {}).get(group)]
            scored = [(s, k) for s, k in scored if s is not None]
            if scored:
                speed, k = max(scored)
                out[tk][group] = {"k": k, "tok_s_median": speed, "swept": len(scored) > 1,
                                  "x_ar": ratio(speed, summaries[AR][tk][group]["tok_s_median"])}
    return out


def run_hf(args: argparse.Namespace, prompts: list, best: dict) -> dict[str, list[Record]]:
    from benchmarks.hf_baseline import HFRunner
    runner = HFRunner(args.target, args.draft, threads=1, cores=[0])
    try:
        records = {"HF AR": runner.run("HF AR", prompts, args.hf_temperatures, args.max_tokens, args.seed,
                                       None, args.warmup_tokens)}
        for temperature in args.hf_temperatures:
            if args.hf_k == "best":
                at_t = best.get(temp_key(temperature)) or next(iter(best.values()), {})
                k: int | str = at_t.get(ALL, {}).get("k", 4)
            else:
                k = args.hf_k if args.hf_k == "default" else int(args.hf_k)
            name = f"HF assisted K={k}"
            records.setdefault(name, []).extend(
                runner.run(name, prompts, [temperature], args.max_tokens, args.seed, k, args.warmup_tokens))
    finally:
        runner.close()
    return records


def report(args, labels, summaries, records, best) -> tuple[dict[str, Any], str]:
    ar = summaries[AR]
    hf_ar = summaries.get("HF AR", {})
    ratios = {name: {tk: {g: {"x_ar": ratio(s["tok_s_median"], ar.get(tk, {}).get(g, {}).get("tok_s_median")),
                              "x_hf_ar": ratio(s["tok_s_median"], hf_ar.get(tk, {}).get(g, {}).get("tok_s_median"))
                              if name.startswith("HF") else None}
                          for g, s in groups.items()} for tk, groups in by_t.items()}
              for name, by_t in summaries.items()}
    equal = {name: same_tokens(recs, records[AR]) for name, recs in records.items() if name != AR}
    lines = [f"# SD vs AR: {args.target} target, {args.draft} draft, bf16, one core, one thread, batch 1", "",
             f"{len(labels)} datasets x {args.prompts} prompts, {args.max_tokens} new tokens, "
             f"enforce_eager={args.enforce_eager}, draft weights {args.draft_weights}, "
             f"draft vocab {args.draft_vocab or 'all'}, "
             f"temperatures {', '.join(f'{t:g}' for t in args.temperatures)} "
             f"(sampling seeded: prompt i uses seed {args.seed}+i).", ""]
    lines += [f"- `{name}`: {label}" for name, label in labels.items()]
    lines += ["", "tok/s: decode tokens per second, median over prompts. xAR: ratio of medians against our AR in this "
              "run (xHF AR: transformers assisted against transformers plain). accept and acc len: acceptance rate and "
              "accepted drafts per round, pooled over prompts (transformers: acc len = new tokens per target forward "
              "- 1). draft/verify ms: per round, median; verify = the round minus drafting (target pass, rejection "
              "sampling, rollback). =AR: greedy requests whose tokens equal AR's (bf16 argmax ties may differ)."]
    for tk in ar:
        rows = []
        for name, by_t in summaries.items():
            for group, s in by_t.get(tk, {}).items():
                r = ratios[name][tk][group]
                same = equal.get(name, (None, None))
                rows.append([name, group, fmt(s["tok_s_median"]), fmt(r["x_ar"]), fmt(r["x_hf_ar"]),
                             fmt(s.get("acceptance_rate"), ".3f"), fmt(s.get("mean_accepted_length")),
                             fmt(s.get("tokens_per_round")), fmt(s.get("draft_ms_median"), ".0f"),
                             fmt(s.get("verify_ms_median"), ".0f"),
                             f"{same[0]}/{same[1]}" if group == ALL and same[1] and tk == "T=0" else "",
                             s["requests"]])
        lines += ["", f"## {tk}{' (greedy)' if tk == 'T=0' else ''}", "",
                  table(["config", "dataset", "tok/s", "xAR", "xHF AR", "accept", "acc len", "tok/rnd", "draft ms",
                         "verify ms", "=AR", "n"], rows)]
    rows = [[tk, g, b["k"] if b["swept"] else f"{b['k']} (not swept)", fmt(b["tok_s_median"]), fmt(b["x_ar"])]
            for tk, groups in best.items() for g, b in groups.items()]
    lines += ["", "## Best K (highest median tok/s among the swept K)", "",
              table(["temperature", "dataset", "best K", "tok/s", "xAR"], rows)]
    ours_ar = ar.get("T=0", {}).get(ALL, {}).get("tok_s_median")
    ours_sd = best.get("T=0", {}).get(ALL, {})
    peers = measured_reference(args.out)
    lines += ["", "## Reference: llama.cpp (the last `saguaro bench peers`, not this run)", ""]
    if peers:
        lines += [f"{peers['file']}: {peers['cpu']}, {peers['threads']} thread(s). This run: our AR {fmt(ours_ar)} "
                  f"tok/s, best SD (K={ours_sd.get('k', '-')}) {fmt(ours_sd.get('tok_s_median'))} tok/s.", "",
                  table(["llama.cpp", "tok/s"], [[label, fmt(v)] for label, v in peers["rows"].items()])]
    else:
        lines.append("No bench_peers.json next to this report: `saguaro bench peers` measures llama.cpp here.")
    payload = {
        "benchmark": "sd",
        "description": __doc__.split("\n\n")[0],
        "models": {"target": args.target, "draft": args.draft, "dtype": "bfloat16", "threads": 1, "cores": [0],
                   "batch": 1},
        "settings": settings(args),
        "environment": environment(),
        "datasets": labels,
        "metric_notes": {"tok_s": "decode tokens/s per request, median over requests",
                         "ratios": "ratio of medians, same run",
                         "acceptance": "pooled over requests (accepted / drafted)"},
        "reference_llama_cpp": peers,
        "summary": summaries,
        "ratios": ratios,
        "best_k": best,
        "greedy_equal_to_ar": {name: {"equal": a, "compared": b} for name, (a, b) in equal.items()},
        "requests": [r.to_json() for recs in records.values() for r in recs],
    }
    return payload, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from saguaro.loading import load_tokenizer
    prompts = prepare_prompts(load_tokenizer(args.target, progress=False), args.datasets, args.prompts)
    labels = dataset_labels(args.datasets)
    configs = plan(args)
    log(f"{len(prompts)} prompts, {len(configs)} engine configurations{'' if args.skip_hf else ' + transformers'}, "
        f"{args.max_tokens} new tokens each")
    records = {name: run_engine(name, options, prompts, args, temps) for name, options, temps in configs}
    sweep = sweep_temperatures(args)
    rest = [t for t in args.temperatures if t not in sweep]
    if rest and args.ks:  # outside the sweep: the best K of the first swept temperature
        k = best_k({n: group_records(r) for n, r in records.items()}, args.ks)[temp_key(sweep[0])][ALL]["k"]
        records[f"SD K={k}"] += run_engine(f"SD K={k}", sd_options(args, k), prompts, args, rest)
    summaries = {name: group_records(recs) for name, recs in records.items()}
    best = best_k(summaries, args.ks)
    if not args.skip_hf:
        hf = run_hf(args, prompts, best)
        records.update(hf)
        summaries.update({name: group_records(recs) for name, recs in hf.items()})
    payload, markdown = report(args, labels, summaries, records, best)
    print(markdown)
    json_path, md_path = write_results(args.out, "bench_sd", payload, markdown)
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
