"""SSD on one device against SD and AR, on a synthetic pair of real shapes; Thm 2 against the measurement; projections.

One run, the same prompts for every configuration, batch 1, bf16:
* the pair: ``synthetic.synthetic_pair`` -- random weights of the target's real shapes with a planted language,
  and the draft its first L layers with the shared head (L from the shape's tuned recipe, or ``--draft-layers``),
  so that greedy acceptance resembles the real Qwen pair's; no real weights are needed;
* AR; SD at every K of ``--sd-k`` (the best K is picked); SSD at each ``--ssd`` configuration (K, fan-out, taper;
  the best is picked), its speculator a thread of the target's process: colocated on the one device, on its own
  CUDA stream on a GPU (pinned to core 1 on a CPU);
* per configuration (``gpu_ssd_rows``): decode tok/s (median over prompts), tokens per round, acceptance, p_hit,
  verification time beside the build against alone, and Thm 2's prediction from this run's pass costs;
* the goals for one GPU: SSD >= 1.3x SD (moonshot 1.5x) and >= 2x AR; verification beside the build <= 1.2x
  alone; predicted within 10% of measured;
* **projections** (``gpu_projection``): the real pair's CPU-measured acceptance and hit curves on the pass costs of
  random models of ``--project`` shape pairs, measured here; labelled as such, they are not measurements.

    python -m benchmarks.bench_gpu_ssd                                     # Qwen2.5 1.5B shapes on cuda:0
    saguaro bench gpu --mode ssd --max-tokens 96 --ssd "4:last3;4:last3@2"
    python -m benchmarks.bench_gpu_ssd --device cpu --shape tiny --project tiny:tiny --prompts 1 --max-tokens 8 \\
        --sd-k 2 --ssd 2:uniform --reps 2 --verify-rows 2,3 --tree-rows 4     # smoke test (CPU: no meaningful speeds)
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_gpu import pass_costs
from benchmarks.build_counters import BuildCounts, build_kind, counting
from benchmarks.common import (Prompt, environment, float_list, fmt, group_records, int_list, log, parse_fan_out,
                               ratio, run_engine, settings, table, temp_key, write_results)
from benchmarks.gpu_projection import PROFILE_PATH, load_profile, project
from benchmarks.gpu_ssd_batches import BatchRow, batch_tables, measure_batches
from benchmarks.gpu_ssd_rows import (ConfigRow, ProjectionRow, SSDShape, best_of, complete, config_row, goal_rows,
                                     lanes_text)
from benchmarks.synthetic import DEFAULT_RECIPES, SHAPES, prompts, random_model, synthetic_pair
from saguaro.ssd.lane_profile import PRIORITIES_ENV, SMS_ENV

PROJECT = "qwen2.5-1.5b:qwen2.5-0.5b,llama-3.1-8b:llama-3.2-1b,qwen2.5-32b:qwen2.5-0.5b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench gpu --mode ssd", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", "--shapes", default="qwen2.5-1.5b", choices=list(DEFAULT_RECIPES),
                   help="the synthetic pair's target shape (default qwen2.5-1.5b)")
    p.add_argument("--draft-layers", type=int, help="L of the layer-skip draft (default: the shape's tuned recipe)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompts", type=int, default=4, help="random-token prompts (default 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64, as tuned)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float_list, default=[0.0], help="comma separated (default 0: greedy)")
    p.add_argument("--seed", type=int, default=1, help="of the prompts; sampled request i uses seed + i")
    p.add_argument("--sd-k", type=int_list, default=[2, 3, 4, 5, 6], help="SD's K sweep (SSD's Ks are added)")
    p.add_argument("--ssd", type=ssd_shapes, default=ssd_shapes("3:last3;4:last3;4:last3@2;5:last3@2"),
                   help="SSD configurations 'K:F' separated by ';', F as in bench ssd --fan-outs: 'uniform', 'lastN' "
                        "or counts F_0..F_K, '@S' tapering the tree after S steps (default "
                        "'3:last3;4:last3;4:last3@2;5:last3@2')")
    p.add_argument("--deep-branches", type=int, default=1, help="branches a tapered tree extends past S (default 1)")
    p.add_argument("--context", type=int, help="tokens before the timed passes (default prompt-len + max-tokens/2)")
    p.add_argument("--reps", type=int, default=20, help="timed repeats per pass shape (default 20)")
    p.add_argument("--verify-rows", type=int_list, default=[2, 3, 4, 5, 6, 7, 8],
                   help="target pass rows timed for the projections (default 2..8)")
    p.add_argument("--tree-rows", type=int_list, default=[8, 16, 32, 64],
                   help="draft tree-step rows timed for the projections (default 8,16,32,64)")
    p.add_argument("--project", type=pairs, default=pairs(PROJECT),
                   help=f"target:draft shape pairs to project onto, comma separated, or 'none' (default {PROJECT})")
    p.add_argument("--profile", type=Path, default=PROFILE_PATH, help=f"the real pair's profile ({PROFILE_PATH})")
    p.add_argument("--enforce-eager", action="store_true", help="the eager reference instead of CUDA graphs")
    p.add_argument("--builds", type=builds, default=["python", "graph"],
                   help="the speculator's builds to run each SSD configuration with, comma separated: python, graph "
                        "(default both; the graph build needs the paged backend: a GPU's, or --paged on a CPU)")
    p.add_argument("--priorities", type=priorities, default=None,
                   help="stream priorities to run each SSD configuration with, comma separated: off, on (both on "
                        "all SMs), auto (the engine's own choice: the overlap probe's verdict for the card, "
                        "saguaro/ssd/lane_profile.py) (default auto,off,on on a GPU; on a CPU there are no streams "
                        "and rows run once)")
    p.add_argument("--paged", action="store_true",
                   help="run every configuration on the paged backend (on a CPU its stand-in, so the graph build runs)")
    p.add_argument("--warmup-tokens", type=int, default=32,
                   help="tokens of one warm-up request per engine (CUDA graphs are captured at start-up; this warms "
                        "the allocator and caches before the timed requests; default 32)")
    p.add_argument("--batches", type=int_list, default=[1],
                   help="batch sizes: 1 is the main table; each size above 1 runs every configuration with that many "
                        "requests together (benchmarks/gpu_ssd_batches.py; default 1)")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--name", default="bench_gpu_ssd")
    args = p.parse_args(argv)
    args.context = args.context or args.prompt_len + args.max_tokens // 2
    if args.priorities is None:
        args.priorities = ["auto", "off", "on"] if torch.device(args.device).type == "cuda" else ["on"]
    args.sd_k = sorted(set(args.sd_k) | {s.k for s in args.ssd})  # verification alone at every SSD K
    args.ssd = [SSDShape(s.k, s.fan_out, s.branch_steps, args.deep_branches if s.branch_steps else 1)
                for s in args.ssd]
    return args


def ssd_shapes(text: str) -> list[SSDShape]:
    out = []
    for item in (x.strip() for x in text.split(";") if x.strip()):
        k, _, spec = item.partition(":")
        try:
            fan_out, steps = parse_fan_out(spec, int(k))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"bad SSD configuration {item!r} ({e}): write K:F, e.g. 4:last3@2")
        if not isinstance(fan_out, list) or not isinstance(steps, (int, type(None))) or len(fan_out) != int(k) + 1:
            raise argparse.ArgumentTypeError(f"SSD configuration {item!r}: F needs K+1 counts (no 'auto' here)")
        out.append(SSDShape(int(k), fan_out, steps))
    if not out:
        raise argparse.ArgumentTypeError("no SSD configuration given")
    return out


def builds(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in ("python", "graph") for x in out):
        raise argparse.ArgumentTypeError(f"builds are python and/or graph, got {text!r}")
    return out


def priorities(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in ("off", "on", "auto") for x in out):
        raise argparse.ArgumentTypeError(f"priorities are off, on and/or auto, got {text!r}")
    return out


@contextmanager
def stream_priorities(setting: str | None):
    """The lanes of the speculator threads started inside: "off" / "on", stream priorities so on all SMs (the
    settings ``saguaro/ssd/lane_profile.py`` reads); "auto" or None, the engine's own choice (settings untouched)."""
    if setting not in ("off", "on"):
        yield
        return
    values = {PRIORITIES_ENV: "1" if setting == "on" else "0", SMS_ENV: "0"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def pairs(text: str) -> list[tuple[str, str]]:
    if text.strip() == "none":
        return []
    out = [tuple(x.strip().split(":")) for x in text.split(",") if x.strip()]
    bad = [":".join(x) for x in out if len(x) != 2 or not all(s in SHAPES for s in x)]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown shape pairs {bad}: write target:draft from {', '.join(SHAPES)}")
    return out  # type: ignore[return-value]


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; target on core 0, "
            f"speculator thread on core 1): a smoke test, not a GPU figure")


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


Config = tuple[str, str, "int | None", "SSDShape | None", dict, "str | None", "str | None"]


def base_options(args) -> dict[str, Any]:
    """The engine options every configuration shares (batch 1)."""
    longest = args.prompt_len + args.max_tokens + 16
    return dict(device=args.device, dtype="bfloat16", enforce_eager=args.enforce_eager, max_num_seqs=1,
                max_model_len=longest, kv_cache_tokens=2 * longest + 1024)


def configurations(args, draft) -> list[Config]:
    """(name, mode, K, SSD shape, options, build, priorities) of every row: AR, SD at each K, and each SSD shape
    with each build and priority setting."""
    configs: list[Config] = [("AR", "ar", None, None, {}, None, None)]
    # every speculative row is the configuration it names: K fixed (adaptive K would choose per round)
    configs += [(f"SD K={k}", "sd", k, None, dict(draft=draft, num_speculative_tokens=k, adaptive=False), None, None)
                for k in args.sd_k]
    paged = args.paged or (torch.device(args.device).type == "cuda" and not args.enforce_eager)
    both = len(args.priorities) > 1
    configs += [(f"{s.name}, {b} build" + (f", priorities {p}" if both else ""), "ssd", s.k, s,
                 dict(draft=draft, num_speculative_tokens=s.k, fan_out=s.fan_out, branch_steps=s.branch_steps,
                      deep_branches=s.deep, miss_strategy="jit", speculator_transport="thread", adaptive=False), b, p)
                for s in args.ssd for b in args.builds if b == "python" or paged for p in args.priorities]
    return configs


def measure(args, target, draft) -> tuple[list[ConfigRow], dict[str, dict[str, float]]]:
    """Every configuration over the same prompts, then the pass costs of the pair; rows completed."""
    ids = prompts(target.config.vocab_size, args.prompts, args.prompt_len, seed=args.seed)
    batch = [Prompt("synthetic", i, "", p) for i, p in enumerate(ids)]
    base, configs = base_options(args), configurations(args, draft)
    rows = []
    for name, mode, k, shape, extra, build, priority in configs:
        graph = build == "graph"
        with build_kind(graph, args.paged), stream_priorities(priority):
            records = run_engine(name, dict(base, mode=mode, **extra), batch, args, target=target)
            counts = count_builds(name, dict(base, mode=mode, **extra), batch, args, target) if mode == "ssd" else None
        summaries = group_records(records)
        for t in args.temperatures:
            at_t = [r for r in records if r.temperature == t]
            row = config_row(name, mode, t, summaries[temp_key(t)]["all"], [x for r in at_t for x in r.rounds], k,
                             shape)
            if counts is not None:
                row.build = build
                row.priorities = priority if torch.device(args.device).type == "cuda" else None  # CPU: no streams
                row.lanes = records[0].extra.get("lanes") if records else None
                row.torch_calls_per_build, row.device_reads_per_round = (counts.torch_calls_per_build,
                                                                         counts.device_reads_per_round)
            rows.append(row)
        free_memory(torch.device(args.device))
    log("pass costs of the pair")
    device, eager = torch.device(args.device), args.enforce_eager
    passes = {"target": pass_costs(target, device, eager, args, sorted({1} | {k + 1 for k in args.sd_k}), []),
              "draft": pass_costs(draft, device, eager, args, [1, 2], sorted({sum(s.fan_out) for s in args.ssd}))}
    complete(rows, passes["target"], passes["draft"])
    return rows, passes


def count_builds(name: str, options: dict[str, Any], batch: list[Prompt], args, target) -> BuildCounts:
    """Torch calls per build and device reads per round, in a short run of their own (counting slows a build);
    a graph-build row whose builds did not all replay the graph fails loudly rather than report the Python's."""
    short = argparse.Namespace(**{**vars(args), "max_tokens": min(args.max_tokens, 24), "warmup_tokens": 0,
                                  "temperatures": args.temperatures[:1]})
    with counting() as counts:
        run_engine(f"{name} (counted)", options, batch[:1], short, target=target)
    if ", graph build" in name and counts.graph_builds < len(counts.calls) // 2:
        log(f"{name}: only {counts.graph_builds} of {len(counts.calls)} builds replayed the graph")
    return counts


def projections(args) -> tuple[list[ProjectionRow], list[str]]:
    """The real pair's profile on each ``--project`` pair's pass costs; notes say what was skipped and why."""
    if not args.project:
        return [], []
    try:
        profile = load_profile(args.profile)
    except ValueError as e:  # ProfileError: another version or layout
        return [], [f"Projections skipped: the profile {args.profile} cannot be read ({e})."]
    if profile is None:
        return [], [f"Projections skipped: no profile of the real pair at {args.profile} (made by `saguaro calibrate "
                    f"--workload code` on the Qwen2.5-Coder pair; carry it to this machine)."]
    device = torch.device(args.device)
    rows, notes = [], []
    for target_shape, draft_shape in args.project:
        log(f"projection: pass costs of {target_shape} / {draft_shape} (random weights)")
        costs = None
        try:
            costs = (shape_costs(args, target_shape, 0, [1] + args.verify_rows, []),
                     shape_costs(args, draft_shape, 1, [1, 2, 8, 32], args.tree_rows))
        except torch.cuda.OutOfMemoryError:
            notes.append(f"{target_shape} / {draft_shape}: skipped, out of device memory.")
        free_memory(device)
        if costs is None:
            continue
        target_ms, draft_ms = costs
        for t in args.temperatures:
            p = project(profile, target_ms, draft_ms, temperature=t, vocab=SHAPES[target_shape]["vocab_size"])
            rows.append(ProjectionRow(target_shape, draft_shape, target_ms["rows_1"], draft_ms["rows_1"],
                                      **{k: p[k] for k in ProjectionRow.__dataclass_fields__ if k in p}))
    notes.append(f"Profile: {args.profile} ({profile.target} / {profile.draft}, workload {profile.workload}, "
                 f"{'eager' if profile.enforce_eager else 'fast path'}, created {profile.created or '-'}).")
    return rows, notes


def shape_costs(args, shape: str, seed: int, rows: list[int], tree_rows: list[int]) -> dict[str, float]:
    """Pass costs of a random model of ``shape`` (built, timed, dropped)."""
    model = random_model(shape, args.device, seed=seed)
    return pass_costs(model, torch.device(args.device), not args.enforce_eager, args, rows, tree_rows)


def report(args, info: dict[str, Any], rows: list[ConfigRow], passes, projected, notes,
           batched: list[BatchRow] = ()) -> str:
    ar = {r.temperature: r.tok_s for r in rows if r.mode == "ar"}
    best = {b.temperature: b for b in best_of(rows)}
    sizes = ", ".join(str(b) for b in sorted({1, *(r.batch for r in batched)}))
    lines = [f"# SSD, SD and AR on one device: synthetic {args.shape} pair, bf16, batch {sizes}", "",
             f"Hardware: {info['hardware']}.", "",
             f"Weights: random weights of real shapes with a planted language (benchmarks/synthetic.py), not real "
             f"models: speeds are the shapes', acceptance is the synthetic pair's. Target {args.shape}; draft its "
             f"first {info['draft_layers']} layers with the shared head ({fmt(info['draft_bytes_share'])} of the "
             f"target's bytes per step).", "",
             f"Prompts: {args.prompts} sequences of {args.prompt_len} random token ids (seed {args.seed}), "
             f"{args.max_tokens} new tokens each, temperatures {', '.join(f'{t:g}' for t in args.temperatures)}. "
             f"SSD's speculator: a thread of the target's process (colocated), jit fallback on a miss.", "",
             "tok/s: decode tokens per second, median over prompts. Times: medians over rounds (ms). verify: SSD's "
             "verification beside the build; alone: SD's at the same K; pass: the bare K+1-row target pass. "
             "predicted: Thm 2 from the pass costs with this run's p_hit, E_hit and E_miss (benchmarks/"
             "gpu_ssd_rows.py). SSD rows run the speculator's Python build or its graph build (one replay per "
             "round); calls/build: torch calls the host makes per build; reads/round: the speculator's device reads "
             "per round (benchmarks/build_counters.py, counted in a short run after the timed one). On a GPU each SSD "
             "row runs with the engine's own arrangement of the GPU (priorities auto: the overlap probe's verdict "
             "for the card, else the default; saguaro/ssd/lane_profile.py) and with stream priorities off and on, "
             "all SMs shared; lanes: the arrangement its speculator thread used and its source."
             + (" Every configuration ran on the paged backend (--paged)." if args.paged else ""), ""]
    for t in args.temperatures:
        at_t = [r for r in rows if r.temperature == t]
        sd_best = best[t].sd_tok_s if t in best else None
        lines += [f"## {temp_key(t)}{' (greedy)' if t == 0 else ''}", "",
                  table(["config", "tok/s", "xAR", "xSD best", "tok/rnd", "accept", "p_hit", "verify", "alone",
                         "beside/alone", "pass", "build", "wait", "E_hit", "E_miss", "predicted tok/s", "error",
                         "calls/build", "reads/round", "lanes"],
                        [[r.name + (" FAILED" if r.failure else ""), fmt(r.tok_s, ".1f"),
                          fmt(ratio(r.tok_s, ar.get(t))), fmt(ratio(r.tok_s, sd_best)),
                          fmt(r.tokens_per_round), fmt(r.acceptance), fmt(r.p_hit), fmt(r.verify_ms, ".3f"),
                          fmt(r.verify_alone_ms, ".3f"), fmt(r.beside_over_alone), fmt(r.verify_pass_ms, ".3f"),
                          fmt(r.build_ms, ".3f"), fmt(r.wait_ms, ".3f"), fmt(r.e_hit), fmt(r.e_miss),
                          fmt(r.predicted_tok_s, ".1f"), fmt(r.prediction_error, "+.1%"),
                          fmt(r.torch_calls_per_build, ".0f"), fmt(r.device_reads_per_round, ".2f"),
                          lanes_text(r.lanes)] for r in at_t]), ""]
        lines += [f"Lanes ({source}): {detail}." for source, detail in dict.fromkeys(
            (r.lanes["source"], r.lanes["detail"]) for r in at_t if r.lanes)] + [""]
        lines += [f"**{r.name} FAILED**: SSD fell back to n-gram SD: {r.failure}. Its figures are n-gram SD's." for r
                  in at_t if r.failure] + ([""] if any(r.failure for r in at_t) else [])
        if t in best:
            b = best[t]
            lines += [f"Best: {b.sd} and {b.ssd}.", "", table(["goal (one GPU)", "measured", "goal", ""],
                                                               goal_rows(b)), ""]
    lines += batch_tables(list(batched))
    lines += ["Pass costs (ms): target " + ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in passes["target"].items()
                                                     if k != "backend")
              + "; draft " + ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in passes["draft"].items() if k != "backend")
              + f"; backend {passes['target']['backend']}.", ""]
    lines += ["## Projections (not measurements)", "",
              "The real Qwen2.5-Coder 1.5B / 0.5B pair's acceptance and cache-hit curves, measured on a CPU, projected "
              "onto pass costs measured here on random weights of each shape pair (benchmarks/gpu_projection.py). "
              "Every pair uses the Qwen pair's curves; the verification is assumed not slowed by the build.", ""]
    if projected:
        lines += [table(["projection: target / draft", "T", "target step ms", "draft step ms", "AR tok/s", "SD K",
                         "SD tok/s", "SSD K", "SSD F", "S", "SSD tok/s", "p_hit", "SSD/SD", "SSD/AR"],
                        [[f"{p.target} / {p.draft}", f"{p.temperature:g}", fmt(p.target_step_ms, ".3f"),
                          fmt(p.draft_step_ms, ".3f"), fmt(p.ar_tok_s, ".1f"), p.sd_k, fmt(p.sd_tok_s, ".1f"), p.ssd_k,
                          fmt(str(p.ssd_fan_out)), fmt(p.ssd_branch_steps, "d"), fmt(p.ssd_tok_s, ".1f"),
                          fmt(p.ssd_p_hit), fmt(p.ssd_x_sd), fmt(p.ssd_x_ar)] for p in projected]), ""]
    lines += notes
    return "\n".join(lines)


def failures(rows: list[ConfigRow], batched: list[BatchRow]) -> dict[str, str]:
    """Configuration -> why its speculator failed (it ran n-gram SD), for every row that failed."""
    return {**{r.name: r.failure for r in rows if r.failure},
            **{f"{r.name}, batch {r.batch}": r.failure for r in batched if r.failure}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench gpu --mode ssd needs a CUDA device (or --device cpu --shape tiny for a smoke test)")
    overrides = {} if args.draft_layers is None else {"draft_layers": args.draft_layers}
    log(f"synthetic {args.shape} pair on {device}")
    target, draft, pair = synthetic_pair(args.shape, args.device, **overrides)
    info = {"hardware": hardware(device), "weights": "random weights of real shapes, planted language "
            "(benchmarks/synthetic.py); layer-skip draft", "prompt_source": "random token ids (benchmarks.synthetic."
            f"prompts, seed {args.seed})", **{k: v for k, v in pair.items() if not torch.is_tensor(v)}}
    rows, passes = measure(args, target, draft)
    batched = measure_batches(args, target, configurations(args, draft), base_options(args), stream_priorities)
    del target, draft
    free_memory(device)
    payload = {"benchmark": "gpu_ssd", "environment": environment(), "settings": settings(args), "pair": info,
               "passes": passes, "failed": failures(rows, batched),
               "rows": [asdict(r) for r in rows], "best": [asdict(b) for b in best_of(rows)],
               "batched_rows": [asdict(r) for r in batched]}
    projected, notes = [], ["Projections: not run yet."]
    write_results(args.out, args.name, payload, report(args, info, rows, passes, projected, notes, batched))  # if cut
    projected, notes = projections(args)
    payload.update(projections=[asdict(p) for p in projected], projection_notes=notes)
    text = report(args, info, rows, passes, projected, notes, batched)
    print(text)
    json_path, md_path = write_results(args.out, args.name, payload, text)
    log(f"wrote {json_path} and {md_path}")
    failed = failures(rows, batched)
    for name, reason in failed.items():
        log(f"FAILED {name}: SSD fell back to n-gram SD: {reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
