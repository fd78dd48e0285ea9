"""SSD against SD and AR on the Qwen pair, with the hardware each one uses made visible.

Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct, bf16, batch 1, the same
real prompts for every configuration, in one run:
  - AR and SD (draft collocated) on one core, one thread: the paper's baselines;
  - AR and SD with two threads over both cores: the extra hardware SSD uses, given to them;
  - SSD with the target on core 0 and the speculator process on core 1, for several fan-outs
    (``--transport process,thread`` also runs each with the speculator in a thread of the
    target's process pinned to core 1, and compares the two transports in a table).
Reported: decode tok/s (median over prompts), ratios against AR and SD of this run, acceptance,
tokens per round, p_hit (and after a hit / after a miss), and per round: verification time,
the target's wait for the speculator, the speculator's cache-build time. The memory-bus
contention between the cores is measured twice: verification per round in SSD against SD on
one core (the other core idle) at the same K, and a controlled probe (saguaro.calibration.contention). A bus
probe (saguaro.calibration.bus) then gives each SSD configuration its ceiling on this machine: the fastest
any SSD at that K could run when every pass streams its weights over the one shared bus
(saguaro.theory.bandwidth; benchmarks.ceiling). A round timeline of one request is drawn to
results/ssd_timeline.png.

    python -m benchmarks.bench_ssd                         # defaults: 2+2 prompts, 64 tokens, greedy, K=4
    python -m benchmarks.bench_ssd --fan-out-sweep 1,2,3,4,6  # adds F=[1,..,1,F_K] for each F_K
    python -m benchmarks.bench_ssd --transport process,thread  # the thread transport against the process
    saguaro bench ssd --prompts 1 --max-tokens 8 --probe-reps 2   # smoke test
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from typing import Any

from benchmarks.common import (ALL, Record, add_common_args, dataset_labels, draft_options,
                               engine_options, environment, failed_configs, fmt, group_records, int_list, log, mean,
                               parse_fan_out, prepare_prompts, ratio, run_engine, same_tokens, settings, table,
                               temp_key, write_results)


TRANSPORT_LABELS = {"process": "2 cores", "thread": "thread, 2 cores"}  # SSD name suffix per speculator transport


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench ssd", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, temperatures="0")
    p.add_argument("--k", type=int, default=4, help="speculative tokens per round for SSD (and SD; default 4)")
    p.add_argument("--sd-k", type=int_list, default=None,
                   help="SD's K values on one core, comma separated (default: SSD's K); SSD is compared with the "
                        "fastest of them, and the first also runs with two threads")
    p.add_argument("--fan-outs", default="uniform;last3",
                   help="SSD fan-outs, ';' separated: 'uniform' (1 per depth), 'lastN' ([1,..,1,N]), 'auto', "
                        "or comma separated counts F_0..F_K (their K may differ from --k); a suffix '@S' tapers "
                        "the tree: every branch S steps, then the likeliest --deep-branches on to K "
                        "(default 'uniform;last3')")
    p.add_argument("--fan-out-sweep", type=int_list, default=[],
                   help="also run F=[1,..,1,F_K] for each F_K given (comma separated)")
    p.add_argument("--deep-branches", type=int, default=1,
                   help="branches a tapered tree ('F@S' in --fan-outs) extends past its S steps (default 1)")
    p.add_argument("--miss-strategy", default="jit", type=miss_strategies,
                   help="SSD miss strategies, comma separated: jit, ngram, random, auto (default jit)")
    p.add_argument("--saguaro-c", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=["1"],
                   help="Saguaro sampling C for SSD, comma separated (each SSD run once per value; 'auto' reads the "
                        "profile; default 1)")
    p.add_argument("--transport", type=transports, default=["process"],
                   help="SSD speculator transport(s), comma separated: process (its own process on core 1), thread "
                        "(a thread of the target's process, pinned to core 1); with both, every SSD configuration "
                        "runs on each and a table compares them (default process)")
    p.add_argument("--skip-two-threads", action="store_true", help="skip AR and SD with two threads")
    p.add_argument("--skip-probe", action="store_true",
                   help="skip the controlled contention probe and the bus probe (and so the bus ceiling)")
    p.add_argument("--bus-seconds", type=float, default=3.0,
                   help="seconds per bus-probe window: each core alone, then both (3 windows each; default 3)")
    p.add_argument("--probe-reps", type=int, default=8, help="timed passes per probe phase (default 8)")
    p.add_argument("--probe-context", type=int, default=256, help="KV context of the probe's passes (default 256)")
    p.add_argument("--timeline-config", type=int, default=0,
                   help="which SSD configuration to draw, in --fan-outs order (default 0: the first)")
    p.add_argument("--timeline-request", type=int, default=0,
                   help="which request of the first SSD configuration to draw (default 0: the first prompt)")
    p.add_argument("--timeline-rounds", type=int, default=40, help="rounds shown in the timeline (default 40)")
    return p.parse_args(argv)


def miss_strategies(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in ("jit", "ngram", "random", "auto")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown miss strategies {bad}: choose from jit, ngram, random, auto")
    return names


def transports(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TRANSPORT_LABELS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown transport(s) {bad}: choose from {', '.join(TRANSPORT_LABELS)}")
    return list(dict.fromkeys(names))


def fan_outs(args: argparse.Namespace) -> list[tuple[list[int] | str, int | None]]:
    """(fan-out, branch_steps) of every SSD run; a spec ending in '@S' tapers its tree after S steps."""
    k = args.k
    out = [parse_fan_out(spec, k) for spec in args.fan_outs.replace(" ", ";").split(";") if spec.strip()]
    out += [([1] * k + [f], None) for f in args.fan_out_sweep]
    unique = []
    for f in out:
        if f not in unique:
            unique.append(f)
    return unique


def fan_out_label(f: list[int] | str) -> str:
    return f if isinstance(f, str) else "[" + ",".join(map(str, f)) + "]"


def plan(args: argparse.Namespace) -> dict[str, Any]:
    k, sd_ks = args.k, args.sd_k or [args.k]
    sd_k = sd_ks[0]
    # fixed K (adaptive=False): the SSD rounds are compared with SD's at the same K (benchmarks/bench_adapt.py
    # measures adaptation)
    one = dict(engine_options(args.enforce_eager, threads=1, target_cores=[0]), adaptive=False)
    two = dict(engine_options(args.enforce_eager, threads=2, target_cores=[0, 1]), adaptive=False)
    names = {"ar1": "AR (1 core)", "sd1": f"SD K={sd_k} (1 core)", "ar2": "AR (2 threads)",
             "sd2": f"SD K={sd_k} (2 threads)"}
    fmt_ = draft_options(args)
    sd_one = [f"SD K={j} (1 core)" for j in sd_ks]
    configs = [(names["ar1"], dict(one, mode="ar"))]
    configs += [(name, dict(one, mode="sd", draft=args.draft, num_speculative_tokens=j, **fmt_))
                for name, j in zip(sd_one, sd_ks)]
    names["sd_ref"] = f"SD K={k} (1 core)"  # verification without contention, at SSD's K (same rows)
    if k not in sd_ks:
        configs.append((names["sd_ref"], dict(one, mode="sd", draft=args.draft, num_speculative_tokens=k, **fmt_)))
        sd_one.append(names["sd_ref"])  # it competes for "fastest SD" too
    if not args.skip_two_threads:
        configs += [(names["ar2"], dict(two, mode="ar")),
                    (names["sd2"], dict(two, mode="sd", draft=args.draft, num_speculative_tokens=sd_k, **fmt_))]
    ssd, ssd_k, by_transport = [], {}, {}
    for strategy, c, (f, steps) in itertools.product(args.miss_strategy, args.saguaro_c, fan_outs(args)):
        k_f = len(f) - 1 if isinstance(f, list) else k
        tag = f", {strategy}" if len(args.miss_strategy) > 1 else ""
        tag += f", tapered {steps}+{args.deep_branches}" if steps else ""
        tag += f", C={c}" if len(args.saguaro_c) > 1 or c != "1" else ""
        base = f"SSD K={k_f} F={fan_out_label(f)}{tag}"
        for transport in args.transport:  # one after the other, on the same prompts
            name = f"{base} ({TRANSPORT_LABELS[transport]})"
            ssd.append(name)
            ssd_k[name] = k_f
            by_transport.setdefault(base, {})[transport] = name
            configs.append((name, dict(one, mode="ssd", draft=args.draft, num_speculative_tokens=k_f, fan_out=f,
                                       miss_strategy=strategy, draft_cores=[1], branch_steps=steps,
                                       deep_branches=args.deep_branches, saguaro_c=c if c == "auto" else float(c),
                                       speculator_transport=transport, **fmt_)))
    return {"configs": configs, "names": names, "ssd": ssd, "ssd_k": ssd_k, "sd_one": sd_one,
            "by_transport": by_transport}


def transport_comparison(plan_, summaries) -> tuple[list[str], dict[str, Any]]:
    """The thread transport against the process, per SSD configuration and temperature (Markdown lines, JSON)."""
    pairs = {base: names for base, names in plan_["by_transport"].items() if len(names) > 1}
    if not pairs:
        return [], {}
    keys = ["tok_s_median", "p_hit", "verify_ms_median", "wait_ms_median", "build_ms_median", "build_steps_mean"]
    payload = {base: {tk: {t: {key: summaries[name][tk][ALL].get(key) for key in keys} for t, name in names.items()}
                      for tk in summaries[names["process"]]} for base, names in pairs.items()}
    lines = ["", "## SSD transports: the speculator thread against the speculator process", "",
             "Same prompts, same run, one after the other. process: the speculator in its own process pinned to core "
             "1, messages packed into tensors over Gloo. thread: the same speculator in a thread of the target's "
             "process pinned to core 1, messages passed as objects; it shares the interpreter lock with the target, "
             "so the Python parts of a build and of a verification take turns. Medians over rounds (ms).", ""]
    rows = []
    for base, by_t in payload.items():
        for tk, by_tr in by_t.items():
            p, t = by_tr["process"], by_tr["thread"]
            rows.append([f"{base}, {tk}", fmt(p["tok_s_median"]), fmt(t["tok_s_median"]),
                         fmt(ratio(t["tok_s_median"], p["tok_s_median"])), fmt(p["p_hit"]), fmt(t["p_hit"])]
                        + [fmt(x[key], ".0f") for key in ("verify_ms_median", "wait_ms_median", "build_ms_median")
                           for x in (p, t)])
    lines.append(table(["config", "tok/s process", "tok/s thread", "thread/process", "p_hit process", "p_hit thread",
                        "verify ms p", "verify ms t", "wait ms p", "wait ms t", "build ms p", "build ms t"], rows))
    return lines, payload


def fastest_sd_bases(plan_, summaries) -> dict[str, dict[str, Any]]:
    """Per temperature: the baselines ratios are taken against, with "sd1" the fastest SD on one core."""
    bases = {}
    for tk in summaries[plan_["names"]["ar1"]]:
        base = {key: summaries.get(name) for key, name in plan_["names"].items()}
        base["sd1"] = max((summaries[n] for n in plan_["sd_one"]), key=lambda by_t: by_t[tk][ALL]["tok_s_median"])
        bases[tk] = base
    return bases


def build_stats(records: list[Record], k: int) -> dict[str, Any]:
    """Builds that overlapped a verification: how long, how many steps, how many ran all K steps."""
    builds = [r for rec in records for r in rec.rounds if r.get("build_ms") is not None]
    overlap = [min(r["build_ms"], r["verify_ms"]) / r["verify_ms"] for r in builds if r.get("verify_ms")]
    return {"builds": len(builds),
            "full_build_fraction": mean(float(r["build_steps"] == k) for r in builds),
            "build_within_verify_fraction": mean(float(r["build_ms"] <= (r["verify_ms"] or 0)) for r in builds),
            "verify_overlapped_by_build_mean": mean(overlap)}


def report(args, labels, plan_, records, summaries, contention, bus=None) -> tuple[dict[str, Any], str]:
    names, k = plan_["names"], args.k
    bases = fastest_sd_bases(plan_, summaries)
    ssd_builds = {name: {temp_key(t): build_stats([r for r in records[name] if r.temperature == t],
                                                  plan_["ssd_k"][name]) for t in args.temperatures}
                  for name in plan_["ssd"]}
    lines = [f"# SSD vs SD vs AR: {args.target} target, {args.draft} draft, bf16, batch 1", "",
             f"{len(labels)} datasets x {args.prompts} prompts, {args.max_tokens} new tokens, "
             f"K={k} (SD: K={','.join(map(str, args.sd_k or [k]))}), "
             f"enforce_eager={args.enforce_eager}, draft weights {args.draft_weights}, "
             f"draft vocab {args.draft_vocab or 'all'}, "
             f"calibration profile {args.calibration_workload}, miss strategy {','.join(args.miss_strategy)}, "
             f"temperatures "
             f"{', '.join(f'{t:g}' for t in args.temperatures)} (sampling seeded: prompt i uses seed {args.seed}+i).",
             "", "Hardware: '1 core' = target (and a collocated draft) pinned to core 0, one thread; '2 threads' = "
             "pinned to cores 0-1, two threads; SSD '2 cores' = target on core 0 (one thread), speculator process "
             "on core 1 (one thread); SSD 'thread, 2 cores' = the same with the speculator in a thread of the "
             "target's process.", ""]
    lines += [f"- `{name}`: {label}" for name, label in labels.items()]
    lines += ["", "tok/s: decode tokens per second, median over prompts; ratios are ratios of medians from this run. "
              "accept: acceptance rate; tok/rnd: tokens per round (accepted + bonus), pooled over prompts. "
              "Per-round times are medians over rounds (ms). SD/AR verify = the round minus drafting; SSD verify = "
              "the target pass with rejection sampling; wait = from sending the outcome to holding the next "
              "speculation; build = the speculator's cache build that overlapped that round's verification. "
              "full builds: builds that finished all K steps before the next request arrived. e2e tok/s: new "
              "tokens over the whole request, prefill included (SSD's draft prefills the prompt on its own core "
              "while the target prefills; SD's draft prefills it on the target's core in the prefill step, so "
              "decode tok/s covers steady-state rounds in both). "
              "xSD 1c and e2e xSD 1c: against the fastest SD on one core in this run, per temperature."]
    for tk in summaries[names["ar1"]]:
        speed_rows, round_rows = [], []
        for name, by_t in summaries.items():
            s = by_t[tk][ALL]
            x = {key: ratio(s["tok_s_median"], (b or {}).get(tk, {}).get(ALL, {}).get("tok_s_median"))
                 for key, b in bases[tk].items()}
            e2e_sd = bases[tk]["sd1"][tk][ALL].get("e2e_tok_s_median")
            speed_rows.append([name, fmt(s["tok_s_median"]), fmt(x["ar1"]), fmt(x["sd1"]), fmt(x["ar2"]),
                               fmt(x["sd2"]), fmt(s.get("e2e_tok_s_median")),
                               fmt(ratio(s.get("e2e_tok_s_median"), e2e_sd)),
                               fmt(s.get("acceptance_rate"), ".3f"), fmt(s.get("tokens_per_round")),
                               fmt(s.get("p_hit")), s["requests"]])
            if name == names["ar1"] or name == names["ar2"]:
                continue
            b = ssd_builds.get(name, {}).get(tk, {})
            round_rows.append([name, fmt(s.get("p_hit")), fmt(s.get("p_hit_after_hit")), fmt(s.get("p_hit_after_miss")),
                               fmt(s.get("draft_ms_median"), ".0f"), fmt(s.get("verify_ms_median"), ".0f"),
                               fmt(s.get("wait_ms_median"), ".0f"), fmt(s.get("wait_ms_mean"), ".0f"),
                               fmt(s.get("build_ms_median"), ".0f"), fmt(s.get("build_steps_mean"), ".1f"),
                               fmt(b.get("full_build_fraction")), fmt(s.get("admit_wait_ms_median"), ".0f")])
        per_dataset = [[name] + [fmt(g["tok_s_median"]) for g in by_t[tk].values()] for name, by_t in summaries.items()]
        lines += ["", f"## {tk}{' (greedy)' if tk == 'T=0' else ''}: speed", "",
                  table(["config", "tok/s", "xAR 1c", "xSD 1c", "xAR 2t", "xSD 2t", "e2e tok/s", "e2e xSD 1c",
                         "accept", "tok/rnd", "p_hit", "n"],
                        speed_rows),
                  "", f"## {tk}: rounds", "",
                  table(["config", "p_hit", "p_hit,p", "p_hit,b", "draft ms", "verify ms", "wait ms", "wait mean",
                         "build ms", "build steps", "full builds", "admit wait ms"], round_rows),
                  "", f"## {tk}: tok/s per dataset", "",
                  table(["config"] + list(next(iter(summaries.values()))[tk]), per_dataset)]
    # contention: in the run, and from the probe
    sd_ref = summaries[names["sd_ref"]]
    rows = []
    for tk in sd_ref:
        sd_verify = sd_ref[tk][ALL].get("verify_ms_median")
        rows.append([f"in run, {tk}: {names['sd_ref']} (other core idle)", fmt(sd_verify, ".0f"), "1.00", "-"])
        for name in plan_["ssd"]:
            v = summaries[name][tk][ALL].get("verify_ms_median")
            rows.append([f"in run, {tk}: {name} (draft building on core 1)", fmt(v, ".0f"), fmt(ratio(v, sd_verify)),
                         "-"])
    if contention:
        rows.append([f"probe: {contention['rows']} rows, other core idle", fmt(contention["idle_ms_median"], ".0f"),
                     "1.00", fmt(contention["target_pass_bytes"] / contention["idle_ms_median"] / 1e6, ".1f")])
        rows += [[f"probe: beside a busy draft, {b['draft_rows']}-row passes back to back",
                  fmt(b["verify_ms_median"], ".0f"), fmt(b["slowdown"]), fmt(b["bus_bytes_per_s"] / 1e9, ".1f")]
                 for b in contention["busy"]]
    lines += ["", "## Memory-bus contention: target verification time per round", "",
              f"Same number of rows (K+1 = {k + 1}). In run: median verify time per round. In SSD the build may "
              "finish before verification does (see full builds), so the in-run figure is a blend of contended and "
              "uncontended time; the probe keeps the draft busy for the whole pass (as the engine runs both, made-up "
              "tokens). bus GB/s: the bytes both moved per second (W_t per verification plus W_d per draft pass).", "",
              table(["measurement", "verify ms", "slowdown", "bus GB/s"], rows)]
    ceiling = []
    if contention and bus:
        from benchmarks.ceiling import ceiling_rows, ceiling_section
        sd_best = {tk: {g: max(summaries[n][tk][g]["tok_s_median"] for n in plan_["sd_one"]) for g in base["sd1"][tk]}
                   for tk, base in bases.items()}
        ceiling = ceiling_rows(plan_, summaries, contention, bus, sd_best)
        lines += ceiling_section(ceiling, contention, bus)
    transport_lines, transports_ = transport_comparison(plan_, summaries)
    lines += transport_lines
    equal = {name: same_tokens(recs, records[names["ar1"]]) for name, recs in records.items() if name != names["ar1"]}
    if any(b for _, b in equal.values()):
        lines += ["", "Greedy outputs equal to AR (1 core), token for token: " +
                  ", ".join(f"{n}: {a}/{b}" for n, (a, b) in equal.items() if b) +
                  " (bf16: a K+1-row pass may round an argmax tie differently; exactness is tested in fp32)."]
    payload = {
        "benchmark": "ssd",
        "description": __doc__.split("\n\n")[0],
        "models": {"target": args.target, "draft": args.draft, "dtype": "bfloat16", "batch": 1},
        "settings": settings(args),
        "environment": environment(),
        "datasets": labels,
        "configs": {name: {k_: v for k_, v in opts.items()} for name, opts in plan_["configs"]},
        "summary": summaries,
        "ratios": {name: {tk: {key: ratio(by_t[tk][ALL]["tok_s_median"],
                                          (b or {}).get(tk, {}).get(ALL, {}).get("tok_s_median"))
                               for key, b in bases[tk].items()} for tk in by_t} for name, by_t in summaries.items()},
        "ssd_builds": ssd_builds,
        "transports": transports_,
        "contention_probe": contention,
        "bus_probe": bus,
        "bus_ceiling": ceiling,
        "greedy_equal_to_ar": {name: {"equal": a, "compared": b} for name, (a, b) in equal.items()},
        "requests": [r.to_json(with_rounds=True) for recs in records.values() for r in recs],
    }
    return payload, "\n".join(lines)


def draw_timeline(args, plan_, records) -> str | None:
    from benchmarks.timeline import CAPTION, plot_timeline
    if not plan_["ssd"]:
        return None
    name = plan_["ssd"][min(args.timeline_config, len(plan_["ssd"]) - 1)]
    recs = records[name]
    rec = recs[min(args.timeline_request, len(recs) - 1)]
    path = plot_timeline(rec.rounds, args.out / "ssd_timeline.png",
                         f"{name}: {rec.dataset}[{rec.prompt_index}], T={rec.temperature:g}, {rec.new_tokens} tokens, "
                         f"{rec.tok_s:.2f} tok/s", plan_["ssd_k"][name], args.timeline_rounds)
    log(f"wrote {path}")
    return f"![SSD round timeline]({path.name})\n\n{CAPTION}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from saguaro.loading import load_tokenizer
    prompts = prepare_prompts(load_tokenizer(args.target, progress=False), args.datasets, args.prompts)
    labels = dataset_labels(args.datasets)
    plan_ = plan(args)
    log(f"{len(prompts)} prompts x {len(args.temperatures)} temperatures x {len(plan_['configs'])} configurations, "
        f"{args.max_tokens} new tokens each")
    records = {name: run_engine(name, options, prompts, args) for name, options in plan_["configs"]}
    summaries = {name: group_records(recs) for name, recs in records.items()}
    contention = bus = None
    if not args.skip_probe:
        from saguaro.calibration.contention import measure
        from saguaro.models.draft_format import DraftFormat
        widths = sorted({1} | {sum(f) for f, _ in fan_outs(args) if isinstance(f, list)})
        probe = measure(args.target, args.draft, args.k + 1, widths, enforce_eager=args.enforce_eager,
                        context=args.probe_context, reps=args.probe_reps,
                        draft_format=DraftFormat(args.draft_weights, args.draft_vocab), log=log)
        contention = asdict(probe)  # the report reads it as the JSON it writes
        from saguaro.calibration.bus import measure_bus
        bus = measure_bus([0, 1], seconds=args.bus_seconds, log=log)
    payload, markdown = report(args, labels, plan_, records, summaries, contention, bus)
    timeline = draw_timeline(args, plan_, records)
    if timeline:
        markdown += "\n\n## Round timeline of one request\n\n" + timeline
    print(markdown)
    json_path, md_path = write_results(args.out, "bench_ssd", payload, markdown)
    log(f"wrote {json_path} and {md_path}")
    failed = failed_configs(records)
    for name, reason in failed.items():
        log(f"FAILED {name}: SSD fell back to n-gram SD: {reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
