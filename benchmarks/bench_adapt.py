"""Adaptive speculation against the best fixed configuration and AR, per dataset, temperature and batch size.

Rows, on the same chat-templated prompts: AR; SD and SSD at each fixed K of ``--ks`` (``adaptive=False``); SD and SSD
adaptive (the default: each request's K chosen every round, 0 to ``--max-k``, over SSD's plan's own cache tree); and SSD
adaptive choosing each round's cache tree too (``TREE_OPTIONS``: fan-outs and taper, opt-in), so the trees' share of the
gain shows. Per dataset and temperature and batch size: tok/s of every row (``--rate``: decode, the tokens after each
request's first over the engine's decode steps, prefill steps out; or total, all new tokens over the batch's wall time),
median over batches, the best fixed configuration chosen after the fact (AR included), and the adaptive rows' ratio to
it and to AR. Batches hold ``--batch`` requests of one dataset, and with ``--mixed`` also one batch of every dataset's
prompts together (code and chat in one batch). The K chosen per round by the adaptive rows is kept for every request
(and SSD's branches per build), and one request per dataset is drawn (``results/bench_adapt_k.png``); the table gives
the adaptive SSD rows' mean branches per build. At batch 1 a second table sets the chooser's predicted gain per K
against what the adaptive SSD rows' rounds gave (``chooser_prices``).

    saguaro bench adapt                                    # Qwen pair, 4 datasets, T=0 and 1, batch 1
    saguaro bench adapt --target smollm2-135m --draft smollm2-135m --draft-weights int4 --prompts 1 \\
        --max-tokens 32 --batch 1,4 --mixed                # a small run
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from typing import Any

from benchmarks.bench_peers import cpu_description
from benchmarks.chooser_prices import as_dicts, price_table, round_prices
from benchmarks.common import (WEIGHT_FORMATS, Prompt, add_common_args, draft_options, engine_options, environment,
                               fmt, int_list, log, median, prepare_prompts, ratio, sampling_params, settings, str_list,
                               table, temp_key, write_results)
from benchmarks.rounds import SSDRounds
from saguaro.adapt_settings import TREE_OPTIONS

DATASETS = "humaneval,mtbench,mtbench-math,mtbench-writing"
MIXED = "mixed"  # the batch of every dataset's prompts together
ORDERS = {False: "Every engine open at once, each batch through all rows in turn (the order rotated per batch).",
          True: "Rows ran one after another (each meets its own minutes' load)."}  # by --sequential
RATES = {"decode": "the tokens after each request's first over the engine's decode steps (prefill steps out)",
         "total": "every request's new tokens over its batch's wall time (prefill included)"}
SEEDING = {False: "are seeded (prompt i: seed + i), so each prices its K from the profile at batch 1",
           True: "carry no seed, so each prices its K from the batch's measured costs"}  # by --unseeded


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench adapt", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, prompts=2, max_tokens=48, temperatures="0,1", datasets=DATASETS)
    p.add_argument("--modes", type=str_list, default=["sd", "ssd"], help="speculative modes (default sd,ssd)")
    p.add_argument("--ks", type=int_list, default=[2, 3, 4, 5], help="fixed K rows (default 2,3,4,5)")
    p.add_argument("--max-k", type=int, default=5, help="the adaptive rows' largest K (default 5)")
    p.add_argument("--batch", type=int_list, default=[1], help="batch sizes, comma separated (default 1)")
    p.add_argument("--mixed", action="store_true", help="also one batch of every dataset's prompts together")
    p.add_argument("--threads", type=int, default=1, help="threads of the target (default 1)")
    p.add_argument("--target-weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="the target's weight format in every row, AR's included (default bf16)")
    p.add_argument("--sequential", action="store_true",
                   help="one row's engine at a time, all its batches, instead of every batch through every engine in "
                        "turn (less memory; rows then meet different load)")
    p.add_argument("--rate", choices=list(RATES), default="decode",
                   help="what the table compares: decode tok/s, prefill out (default), or total, prefill included")
    p.add_argument("--unseeded", action="store_true",
                   help="sampled requests carry no seed, as a server's usually do: each prices its rounds from the "
                        "batch's measured costs (a seeded one from the profile at batch 1, to draw alike in any batch)")
    args = p.parse_args(argv)
    if any(m not in ("sd", "ssd") for m in args.modes) or min(args.ks, default=1) < 1 or args.max_k < 1:
        p.error("--modes takes sd and ssd; --ks and --max-k must be >= 1")
    return args


def configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(row name, LLM options): AR, each mode at each fixed K, each mode adaptive."""
    cores = list(range(args.threads))
    base = dict(engine_options(args.enforce_eager, threads=args.threads, target_cores=cores,
                               draft_cores=[args.threads]), max_num_seqs=max(args.batch + [1]) * 4,
                target_weights=args.target_weights)
    out = [("AR", dict(base, mode="ar"))]
    for mode in args.modes:
        spec = dict(base, mode=mode, draft=args.draft, **draft_options(args))
        out += [(f"{mode.upper()} K={k}", dict(spec, num_speculative_tokens=k, adaptive=False)) for k in args.ks]
        out.append((f"{mode.upper()} adaptive K<={args.max_k}", dict(spec, num_speculative_tokens=args.max_k)))
        if mode == "ssd":
            out.append((f"SSD adaptive K<={args.max_k} trees",
                        dict(spec, num_speculative_tokens=args.max_k, adapt=dict(TREE_OPTIONS))))
    return out


def batches(prompts: list[Prompt], size: int, mixed: bool) -> list[tuple[str, list[Prompt]]]:
    """(dataset or MIXED, prompts) per batch: ``size`` prompts of one dataset each, and the mixed batch."""
    out = []
    for name in dict.fromkeys(p.dataset for p in prompts):
        mine = [p for p in prompts if p.dataset == name]
        out += [(name, mine[i:i + size]) for i in range(0, len(mine), size)]
    if mixed:
        out.append((MIXED, prompts))
    return out


def work(prompts: list[Prompt], args: argparse.Namespace) -> list[tuple[float, int, str, list[Prompt]]]:
    """(temperature, batch size, dataset or MIXED, prompts): every batch measured, in order."""
    return [(t, size, group, batch) for t in args.temperatures for size in args.batch
            for group, batch in batches(prompts, size, args.mixed and size == args.batch[-1])]


def measure(name: str, llm, item: tuple[float, int, str, list[Prompt]], args: argparse.Namespace) -> dict[str, Any]:
    """One batch through one engine: its rates, outputs and K per round."""
    temperature, size, group, batch = item
    params = [sampling_params(temperature, args.max_tokens, None if args.unseeded else args.seed + p.index)
              for p in batch]
    engine = getattr(llm, "engine", None)
    decoder = getattr(engine, "decoder", None)
    rounds = SSDRounds(decoder) if hasattr(decoder, "trace") else None  # SSD's rounds, timed
    first = len(rounds) if rounds is not None else 0
    steps = dict(getattr(engine, "step_seconds", {}))
    start = time.perf_counter()
    outs = llm.generate([p.ids for p in batch], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    # decode: the tokens after each request's first over the engine's decode steps (prefill out), total: every new
    # token over the batch's wall time. A batch's prompts are prefilled in chunks between the others' decode
    # rounds, so the time after its last first token would leave most of its decoding out (2x the rate at 8)
    if steps:
        decode_s = engine.step_seconds["decode"] - steps["decode"]
    else:
        decode_s = wall - max(o.timings.ttft_s for o in outs)
    decode = (tokens - len(outs)) / decode_s if decode_s > 0 else 0.0
    run = {"config": name, "dataset": group, "temperature": temperature,
           "batch": len(batch) if group == MIXED else size,
           "tok_s": decode if args.rate == "decode" else tokens / wall,
           "decode_tok_s": decode, "total_tok_s": tokens / wall,
           "tokens": tokens, "wall_s": wall, "token_ids": [o.token_ids for o in outs],
           "datasets": [p.dataset for p in batch], "prompts": [p.index for p in batch],
           "k_per_round": [o.spec.k_per_round if o.spec else [] for o in outs],
           "fan_out_per_round": [o.spec.fan_out_per_round if o.spec else [] for o in outs],
           "acceptance": [o.spec.acceptance_rate if o.spec else None for o in outs]}
    if rounds is not None and len(outs) == 1 and outs[0].spec and outs[0].spec.gain_per_round:
        spec = outs[0].spec  # alone, its rounds are the trace's since it was sent
        run["round_prices"] = as_dicts(round_prices(rounds.slice(first, len(rounds)), spec.k_per_round,
                                                    spec.gain_per_round))
    log(f"  {name} | {group} T={temperature:g} b={run['batch']}: {tokens} tokens, {run['tok_s']:.2f} tok/s")
    return run


def open_engine(stack: ExitStack, name: str, options: dict[str, Any], prompts: list[Prompt],
                args: argparse.Namespace):
    from saguaro import LLM
    log(f"{name}: loading")
    llm = stack.enter_context(LLM(target=args.target, **options))
    if args.warmup_tokens:
        llm.generate([prompts[0].ids], sampling_params(0, args.warmup_tokens, None))
    return llm


def run_rows(rows: list[tuple[str, dict[str, Any]]], prompts: list[Prompt], args: argparse.Namespace
             ) -> list[dict[str, Any]]:
    """Every batch through every row's engine. Interleaved (the default): every engine open at once, each batch
    run through all of them in turn, the order rotated batch by batch, so that every row meets the same load of
    a shared machine (a row's minutes apart from the others' can differ by half); ``--sequential``: one engine
    at a time, all its batches (one engine's memory)."""
    items, runs = work(prompts, args), []
    if args.sequential:
        for name, options in rows:
            with ExitStack() as stack:
                llm = open_engine(stack, name, options, prompts, args)
                runs += [measure(name, llm, item, args) for item in items]
        return runs
    with ExitStack() as stack:
        engines = [(name, open_engine(stack, name, options, prompts, args)) for name, options in rows]
        for i, item in enumerate(items):
            shift = i % len(engines)
            runs += [measure(name, llm, item, args) for name, llm in engines[shift:] + engines[:shift]]
    return runs


def summarize(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """One cell per (temperature, dataset, batch): median tok/s per row, the best fixed row, the ratios."""
    cells = []
    keys = list(dict.fromkeys((r["temperature"], r["dataset"], r["batch"]) for r in runs))
    for t, dataset, batch in keys:
        at = [r for r in runs if (r["temperature"], r["dataset"], r["batch"]) == (t, dataset, batch)]
        speed = {n: median(r["tok_s"] for r in at if r["config"] == n) for n in names}
        total = {n: median(r.get("total_tok_s") for r in at if r["config"] == n) for n in names}
        fixed = {n: s for n, s in speed.items() if "adaptive" not in n and s is not None}
        best = max(fixed, key=fixed.get) if fixed else None
        cell = {"temperature": t, "dataset": dataset, "batch": batch, "tok_s": speed, "total_tok_s": total,
                "best_fixed": best,
                "mean_fan_out": {n: mean_fan_out([r for r in at if r["config"] == n]) for n in names}}
        for n in names:
            if "adaptive" in n:
                cell[f"{n} x best fixed"] = ratio(speed[n], fixed.get(best))
                cell[f"{n} x AR"] = ratio(speed[n], speed.get("AR"))
                cell[f"{n} x AR total"] = ratio(total[n], total.get("AR"))  # prefill in: a batch's wait for all
        cells.append(cell)
    return cells


def mean_fan_out(runs: list[dict[str, Any]]) -> float | None:
    """Mean branches asked of a build per request and speculating round (None: no SSD build recorded)."""
    built = [f for r in runs for row in r.get("fan_out_per_round", []) for f in row if f]
    return sum(built) / len(built) if built else None


def greedy_equal(runs: list[dict[str, Any]]) -> tuple[int, int]:
    """(greedy speculative outputs equal to AR's for the same prompt, compared): the rows stay exact."""
    pairs = greedy_pairs(runs)
    return sum(a == b for _, a, b in pairs), len(pairs)


def greedy_unequal(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The greedy outputs that differ from AR's, and the first token where they do."""
    return [dict(where, first_difference=next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            for where, a, b in greedy_pairs(runs) if a != b]


def greedy_pairs(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int], list[int]]]:
    # against AR's output for the same prompt in a batch of the same size (bf16 rounding depends on the batch)
    ar = {(d, p, r["batch"]): ids for r in runs if r["config"] == "AR" and r["temperature"] == 0
          for d, p, ids in zip(r["datasets"], r["prompts"], r["token_ids"])}
    return [({"config": r["config"], "dataset": d, "prompt": p, "batch": r["batch"]}, ids, ar[(d, p, r["batch"])])
            for r in runs if r["config"] != "AR" and r["temperature"] == 0
            for d, p, ids in zip(r["datasets"], r["prompts"], r["token_ids"]) if (d, p, r["batch"]) in ar]


def chooser_prices(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per temperature, dataset and adaptive SSD row at batch 1: the chooser's predicted gain per K against what
    the rounds gave, each request's in steps of AR's on its prompt (``chooser_prices``)."""
    ar = {(r["temperature"], r["dataset"], r["prompts"][0]): 1 / r["decode_tok_s"] for r in runs
          if r["config"] == "AR" and r["batch"] == 1 and r["decode_tok_s"] > 0}
    out = []
    keys = dict.fromkeys((r["temperature"], r["dataset"], r["config"]) for r in runs if "round_prices" in r)
    for t, dataset, config in keys:
        requests = [(r["round_prices"], ar[(t, dataset, r["prompts"][0])]) for r in runs
                    if (r["temperature"], r["dataset"], r["config"]) == (t, dataset, config) and "round_prices" in r
                    and (t, dataset, r["prompts"][0]) in ar]
        out += [dict(temperature=t, dataset=dataset, config=config, **row) for row in price_table(requests)]
    return out


def report(args, names, runs, cells) -> tuple[dict[str, Any], str]:
    adaptive = [n for n in names if "adaptive" in n]
    trees = [n for n in adaptive if n.startswith("SSD")]
    headers = ["T", "dataset", "b", *names, "best fixed", *(f"{n} x best" for n in adaptive),
               *(f"{n} x AR" for n in adaptive), *(f"{n} x AR total" for n in adaptive),
               *(f"{n} branches/build" for n in trees)]
    rows = [[temp_key(c["temperature"]), c["dataset"], c["batch"], *(fmt(c["tok_s"][n]) for n in names),
             c["best_fixed"] or "-", *(fmt(c[f"{n} x best fixed"]) for n in adaptive),
             *(fmt(c[f"{n} x AR"]) for n in adaptive), *(fmt(c[f"{n} x AR total"]) for n in adaptive),
             *(fmt(c["mean_fan_out"][n]) for n in trees)] for c in cells]
    equal, compared = greedy_equal(runs)
    env = environment()
    cpu = cpu_description()
    lines = [f"# Adaptive K against the best fixed configuration and AR: {args.target} target, {args.draft} draft "
             f"({args.draft_weights}), target weights {args.target_weights}", "",
             f"CPU: {cpu['summary']}.",
             f"{args.prompts} prompt(s) per dataset, {args.max_tokens} new tokens, {args.threads} target thread(s), "
             f"the speculator on the next core. Sampled requests {SEEDING[args.unseeded]}. "
             f"tok/s: {RATES[args.rate]}, median over batches; x AR total: {RATES['total']}. "
             f"{ORDERS[args.sequential]} Load average at the end: "
             f"{', '.join(f'{x:.1f}' for x in env['loadavg'] or [])} on {env['cpus']} cores.", "",
             table(headers, rows), "",
             f"Greedy speculative outputs equal to AR's: {equal}/{compared}" + (
                 "" if equal == compared else
                 " (the others, and where they part from AR's, are in the JSON's greedy_unequal: in bf16 a verification"
                 " of K + 1 rows may round a near-tie otherwise than AR's one row; exactness is checked in fp32)")
             + "."]
    prices = chooser_prices(runs)
    if prices:
        lines += ["", "The chooser's prices against its rounds (batch 1, SSD; `benchmarks/chooser_prices.py`): per K "
                  "verified, the speedup over AR predicted when it was chosen, and the rounds' tokens over their "
                  "time in AR steps (the AR row's on the same prompt).", "",
                  table(["T", "dataset", "row", "K", "rounds", "predicted", "realized"],
                        [[temp_key(p["temperature"]), p["dataset"], p["config"], p["k"], p["rounds"],
                          fmt(p["predicted"]), fmt(p["realized"])] for p in prices])]
    payload = {"benchmark": "adapt", "description": __doc__.split("\n\n")[0], "settings": settings(args),
               "environment": env, "cpu": cpu, "rows": names, "cells": cells, "greedy_equal_ar": [equal, compared],
               "greedy_unequal": greedy_unequal(runs), "chooser_prices": prices,
               "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}
    return payload, "\n".join(lines)


def plot_k(runs: list[dict[str, Any]], path) -> str | None:
    """The K chosen per round for the first request of each dataset (batch 1), one panel per adaptive row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [r for r in runs if "adaptive" in r["config"] and r["batch"] == 1 and r["dataset"] != MIXED]
    rows = list(dict.fromkeys(r["config"] for r in shown))
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 2.6 * len(rows)), squeeze=False)
    for ax, name in zip(axes[:, 0], rows):
        seen = set()
        for r in shown:
            key = (r["dataset"], r["temperature"])
            if r["config"] != name or key in seen:
                continue
            seen.add(key)
            ax.step(range(len(r["k_per_round"][0])), r["k_per_round"][0], where="post",
                    label=f"{r['dataset']} T={r['temperature']:g}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("K")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from saguaro.loading import load_tokenizer
    prompts = prepare_prompts(load_tokenizer(args.target, progress=False), args.datasets, args.prompts)
    rows = configs(args)
    runs = run_rows(rows, prompts, args)
    names = [n for n, _ in rows]
    cells = summarize(runs, names)
    payload, markdown = report(args, names, runs, cells)
    args.out.mkdir(parents=True, exist_ok=True)
    payload["plot"] = plot_k(runs, args.out / "bench_adapt_k.png")
    write_results(args.out, "bench_adapt", payload, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
