"""llama.cpp beside Saguaro on this CPU: the same GGUF files, the same prompts, one run.

Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct, both the Q4_K_M files the
registry assembles; BF16 copies of them are written once by llama.cpp's ``llama-quantize`` (every
tensor dequantized: the same weights Saguaro holds in bf16 after dequantizing the Q4_K_M file).
Greedy, batch 1, HumanEval prompts in the chat template, ``--threads`` threads pinned to the first
cores. Rows (``--only`` takes their keys, or ``llama.cpp`` / ``saguaro``):

  llama.cpp (built once from the pinned source package, benchmarks/llama_cpp.py): AR on the 1.5B in
  BF16 and Q4_K_M, AR on the 0.5B Q4_K_M (the draft alone), and ``llama-speculative-simple`` with the
  BF16 pair and the Q4_K_M pair (draft and target take turns on the same threads).
  Saguaro: AR (bf16 target), SD (bf16 target, int4 draft with a reduced head, collocated) and SSD
  (the same draft in a speculator process on the next cores: the extra hardware SSD uses); then the
  same three with the target in Saguaro's int4 (``target_weights="int4"``: a quantized model of its
  own, as llama.cpp's Q4_K_M file is; SD and SSD exact to it).

Reported: decode tok/s (median over prompts) with the ratio to the fastest llama.cpp row that decodes
the 1.5B target and to Saguaro's AR of this run, acceptance, the prompt token counts each side saw.

    saguaro bench peers                                         # 3 prompts, 48 tokens, 1 thread
    saguaro bench peers --prompts 1 --max-tokens 8 --only llama-q4-ar,saguaro-ar   # smoke test
    saguaro bench peers --only llama.cpp --memory      # + resident memory and load time (peer_memory.py)
    saguaro bench peers --only llama-bf16-ar,saguaro-ar --memory   # the memory table, llama.cpp's rows beside
    saguaro bench peers --only llama-bf16-ar,llama-q4-ar,saguaro-ar,saguaro-q4-ar --prefill 512,2048,8192
                                                       # + prompt tokens/s at each length (peer_prefill.py)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import llama_cpp as lc
from benchmarks.common import (DRAFT, TARGET, Prompt, add_common_args, draft_options, engine_options, environment,
                               fmt, int_list, log, prepare_prompts, ratio, run_engine, settings, summarize_records,
                               table, write_results)
from benchmarks import peer_prefill
from benchmarks.peer_memory import LLAMA_MEMORY_ROWS, TOKENS as MEMORY_TOKENS, measure as measure_memory, \
    measure_llama, memory_table
from saguaro.loading.paths import cache_root

LLAMA, SAGUARO = "llama.cpp", "saguaro"


@dataclass(frozen=True)
class Row:
    """One configuration of the table."""
    key: str  # what --only names
    engine: str  # LLAMA or SAGUARO
    label: str
    target: str | None = None  # llama.cpp: the model file key (see model_files); None for Saguaro
    draft: str | None = None  # llama.cpp speculative: the draft file key
    decodes_target: bool = True  # False for the draft alone: not a candidate for "llama.cpp fastest"


ROWS = (
    Row("llama-bf16-ar", LLAMA, "llama.cpp AR, 1.5B BF16", "target-bf16"),
    Row("llama-q4-ar", LLAMA, "llama.cpp AR, 1.5B Q4_K_M", "target-q4"),
    Row("llama-draft-q4-ar", LLAMA, "llama.cpp AR, 0.5B Q4_K_M (draft alone)", "draft-q4", decodes_target=False),
    Row("llama-bf16-spec", LLAMA, "llama.cpp speculative, BF16 pair", "target-bf16", "draft-bf16"),
    Row("llama-q4-spec", LLAMA, "llama.cpp speculative, Q4_K_M pair", "target-q4", "draft-q4"),
    Row("saguaro-ar", SAGUARO, "Saguaro AR, 1.5B bf16"),
    Row("saguaro-sd", SAGUARO, "Saguaro SD, bf16 target, int4 draft"),
    Row("saguaro-ssd", SAGUARO, "Saguaro SSD, bf16 target, int4 draft (+ speculator cores)"),
    # the target itself in Saguaro's int4 (groups of 32): a quantized model, as llama.cpp's Q4_K_M file is
    Row("saguaro-q4-ar", SAGUARO, "Saguaro AR, 1.5B int4"),
    Row("saguaro-q4-sd", SAGUARO, "Saguaro SD, int4 target, int4 draft"),
    Row("saguaro-q4-ssd", SAGUARO, "Saguaro SSD, int4 target, int4 draft (+ speculator cores)"),
)

RUN_ORDER = ("saguaro-ar", "llama-bf16-ar", "llama-q4-ar", "saguaro-q4-ar", "saguaro-sd", "llama-q4-spec",
             "saguaro-ssd", "saguaro-q4-sd", "saguaro-q4-ssd", "llama-bf16-spec", "llama-draft-q4-ar")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, prompts=3, max_tokens=48, temperatures="0", datasets="humaneval")
    p.set_defaults(draft_weights="int4", draft_vocab=65536)
    p.add_argument("--threads", type=int, default=1,
                   help="threads of every engine, pinned to cores 0..N-1 (default 1)")
    p.add_argument("--k", type=int, default=4,
                   help="draft tokens per round: llama.cpp's --spec-draft-n-max and SD's K (default 4)")
    p.add_argument("--fan-out", type=int_list, default=[1, 1, 1, 1, 2],
                   help="SSD fan-out F_0..F_K; its K is the length minus one (default 1,1,1,1,2)")
    p.add_argument("--branch-steps", type=int, default=2, help="SSD build steps every branch takes (default 2)")
    p.add_argument("--only", type=only_keys, default=[r.key for r in ROWS],
                   help=f"comma separated row keys, or {LLAMA} / {SAGUARO}: {', '.join(r.key for r in ROWS)}")
    p.add_argument("--skip-build", action="store_true",
                   help="never build llama.cpp: use the cached build, or fail if there is none")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs of the build")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one llama.cpp program may run (default 900)")
    p.add_argument("--memory", action="store_true",
                   help="also resident memory and load times: Saguaro bf16/int8/int4 AR and SSD in fresh "
                        "processes, and llama.cpp BF16 and Q4_K_M where llama.cpp rows run")
    peer_prefill.add_args(p)
    args = p.parse_args(argv)
    peer_prefill.check_args(p, args)
    if any(t != 0 for t in args.temperatures):
        p.error("only greedy decoding (--temperatures 0) is compared with llama.cpp")
    if args.threads < 1 or args.k < 1:
        p.error("--threads and --k must be at least 1")
    return args


def only_keys(text: str) -> list[str]:
    keys: list[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        group = [r.key for r in ROWS if r.engine == item]
        if not group and item not in {r.key for r in ROWS}:
            raise argparse.ArgumentTypeError(f"unknown row {item!r}: choose from {LLAMA}, {SAGUARO}, "
                                             + ", ".join(r.key for r in ROWS))
        keys += group or [item]
    return [r.key for r in ROWS if r.key in keys]  # table order


# -- the machine ------------------------------------------------------------------------------
ZEN = {(25, 0): "Zen 3", (25, 1): "Zen 4", (25, 2): "Zen 3", (25, 4): "Zen 3",
       (25, 5): "Zen 3", (25, 6): "Zen 4", (25, 7): "Zen 4", (26, 0): "Zen 5", (26, 1): "Zen 5", (26, 2): "Zen 5"}
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_description(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU model and the SIMD flags the kernels of both engines care about."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    have = [f for f in CPU_FLAGS if f in flags]
    name = fields.get("model name", "unknown CPU")
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model and model.isdigit():
        # a VM may hide the marketing name ("AMD EPYC"): family/model still tell the core generation
        zen = ZEN.get((int(family), int(model) // 16)) if family.isdigit() else None
        name += f" (family {family} model {model}{': ' + zen if zen else ''})"
    tier = kernel_tier()
    return {"model": name, "cores": os.cpu_count(), "simd": have, "kernel_tier": tier,
            "summary": f"{name}, {os.cpu_count()} cores, {' '.join(have) or 'no AVX'}; Saguaro's kernels: {tier}"}


def kernel_tier() -> str:
    """The CPU kernel tier Saguaro runs here, and why (forced, or the best this CPU executes)."""
    from saguaro.backends.cpu_kernels.build import KernelsUnavailable, chosen_tier, why
    try:
        tier = chosen_tier()
    except KernelsUnavailable as e:
        return f"none ({e})"
    return f"{tier} ({why(tier)})"


# -- the files ----------------------------------------------------------------------------------
def model_files(build: lc.Build | None, keys: set[str], log_=log) -> dict[str, Path]:
    """The GGUF files the llama.cpp rows need: the registry's Q4_K_M files, BF16 copies made once in the cache."""
    from saguaro.loading.registry import asset_path, resolve
    q4 = {"target": asset_path(resolve(TARGET), progress=False), "draft": asset_path(resolve(DRAFT), progress=False)}
    files = {f"{role}-q4": path for role, path in q4.items()}
    for role, src in q4.items():
        key = f"{role}-bf16"
        if key not in keys:
            continue
        dst = cache_root() / "peers" / "gguf" / f"{src.stem.removesuffix('-q4_k_m')}-bf16.gguf"
        if not dst.is_file():
            assert build is not None  # only llama.cpp rows ask for BF16 files
            dst.parent.mkdir(parents=True, exist_ok=True)
            log_(f"writing {dst.name} with llama-quantize")
            tmp = dst.with_suffix(f".tmp{os.getpid()}")
            lc.run_tool(lc.quantize_command(build, src, tmp), timeout_s=1800)
            tmp.replace(dst)
        files[key] = dst
    return files


# -- runs -----------------------------------------------------------------------------------------
def llama_command(row: Row, build: lc.Build, files: dict[str, Path], prompt_file: Path,
                  args: argparse.Namespace) -> list[str]:
    assert row.target is not None
    if row.draft is None:
        return lc.completion_command(build, files[row.target], prompt_file, args.max_tokens, args.threads)
    return lc.speculative_command(build, files[row.target], files[row.draft], prompt_file, args.max_tokens,
                                  args.threads, args.k)


def run_llama(row: Row, build: lc.Build, files: dict[str, Path], prompts: list[Prompt],
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every prompt through one llama.cpp program, a fresh process each (the file stays in the page cache)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="saguaro-peers-") as tmp:
        for p in prompts:
            prompt_file = Path(tmp) / f"{p.dataset}-{p.index}.txt"
            prompt_file.write_text(p.chat)
            cmd = llama_command(row, build, files, prompt_file, args)
            stdout, stderr = lc.run_tool(cmd, args.timeout, cores=list(range(args.threads)))
            timing = (lc.parse_speculative if row.draft else lc.parse_completion)(stdout + "\n" + stderr)
            out.append({"dataset": p.dataset, "prompt_index": p.index, "prompt_tokens_ours": len(p.ids),
                        **asdict(timing), "text": stdout})
            log(f"  {row.key} | {p.dataset}[{p.index}]: {timing.decode_tokens} tokens, {timing.tok_s:.2f} tok/s"
                + (f", acceptance {timing.acceptance:.2f}" if timing.acceptance is not None else ""))
    return out


def saguaro_options(row: Row, args: argparse.Namespace) -> dict[str, Any]:
    cores = list(range(args.threads))
    spare = [(c + args.threads) % (os.cpu_count() or 1) for c in cores]  # the speculator's cores
    base = engine_options(args.enforce_eager, threads=args.threads, target_cores=cores, draft_cores=spare)
    if row.key.startswith("saguaro-q4-"):
        base["target_weights"] = "int4"
    if row.key.endswith("-ar"):
        return dict(base, mode="ar")
    if row.key.endswith("-sd"):
        return dict(base, mode="sd", draft=args.draft, num_speculative_tokens=args.k, **draft_options(args))
    return dict(base, mode="ssd", draft=args.draft, num_speculative_tokens=len(args.fan_out) - 1, fan_out=args.fan_out,
                branch_steps=args.branch_steps, **draft_options(args))


def saguaro_label(row: Row, args: argparse.Namespace) -> str:
    target = "int4 target" if row.key.startswith("saguaro-q4-") else "bf16 target"
    if row.key.endswith("-sd"):  # K adapts per request and round, up to --k (the engine's default)
        return f"Saguaro SD K={args.k} (adaptive), {target}, {args.draft_weights} draft"
    if row.key.endswith("-ssd"):
        return (f"Saguaro SSD K={len(args.fan_out) - 1} (adaptive) F=[{','.join(map(str, args.fan_out))}] tapered "
                f"{args.branch_steps}, {target}, {args.draft_weights} draft (speculator on its own cores)")
    return row.label


def llama_label(row: Row, args: argparse.Namespace) -> str:
    return f"{row.label}, draft {args.k}" if row.draft else row.label


# -- summary and report ------------------------------------------------------------------------------
def summarize_llama(runs: list[dict[str, Any]]) -> dict[str, Any]:
    speeds = [r["tok_s"] for r in runs]
    drafted = sum(r["drafted"] or 0 for r in runs)
    accepted = sum(r["accepted"] or 0 for r in runs)
    seen = [(r["prompt_tokens"], r["prompt_tokens_ours"]) for r in runs if r["prompt_tokens"] is not None]
    return {"requests": len(runs), "tok_s_median": statistics.median(speeds) if speeds else None,
            "tok_s_min": min(speeds, default=None), "tok_s_max": max(speeds, default=None),
            "acceptance_rate": accepted / drafted if drafted else None,
            "prompt_tokens_equal": sum(a == b for a, b in seen), "prompt_tokens_compared": len(seen)}


def speed_table(rows: list[Row], labels: dict[str, str], summaries: dict[str, dict[str, Any]]) -> tuple[str, dict]:
    """The table, and each row's ratios to the fastest llama.cpp row on the target and to Saguaro's AR."""
    llama = [r.key for r in rows if r.engine == LLAMA and r.decodes_target]
    fastest = max(llama, key=lambda k: summaries[k]["tok_s_median"] or 0, default=None)
    best = summaries[fastest]["tok_s_median"] if fastest else None
    ours = summaries.get("saguaro-ar", {}).get("tok_s_median")
    lines, ratios = [], {}
    for r in rows:
        s = summaries[r.key]
        ratios[r.key] = {"x_llama_fastest": ratio(s["tok_s_median"], best),
                         "x_saguaro_ar": ratio(s["tok_s_median"], ours)}
        lines.append([labels[r.key], fmt(s["tok_s_median"]), f"{fmt(s['tok_s_min'])}-{fmt(s['tok_s_max'])}",
                      fmt(ratios[r.key]["x_llama_fastest"]), fmt(ratios[r.key]["x_saguaro_ar"]),
                      fmt(s.get("acceptance_rate"), ".3f"), s["requests"]])
    return table(["config", "tok/s", "min-max", "x llama.cpp fastest", "x Saguaro AR", "accept", "n"], lines), \
        {"llama_fastest": fastest, "ratios": ratios}


def report(args, rows, labels, summaries, llama_runs, commands, files, cpu, versions) -> tuple[dict, str]:
    speed, ratios = speed_table(rows, labels, summaries)
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    lines = [f"# llama.cpp and Saguaro side by side: {args.target} target, {args.draft} draft, batch 1, greedy", "",
             f"CPU: {cpu['summary']}. {threads} per engine, pinned to the first {args.threads} core(s) "
             "(Saguaro SSD's speculator on the next cores). "
             f"{args.prompts} HumanEval prompts (chat template), {args.max_tokens} new tokens. "
             f"llama.cpp: {versions['llama_cpp']}; Saguaro {versions['saguaro_commit'] or '(no git commit)'}, "
             f"torch {versions['torch']}.", "",
             "tok/s: decode tokens per second, median over prompts (llama.cpp: its own timing lines; AR: tokens "
             "after the first over the time after the prompt pass, as Saguaro's; speculative: every token over "
             "the time after the prompt pass). x llama.cpp fastest: against the fastest llama.cpp row that decodes "
             f"the 1.5B target ({labels.get(ratios['llama_fastest'], '-')}). accept: accepted over drafted tokens, "
             "pooled over prompts.", "", speed, ""]
    lines += ["Files: " + "; ".join(f"`{k}` {Path(p).name} ({Path(p).stat().st_size / 1e9:.2f} GB)"
                                    for k, p in files.items()) + ". BF16 files: llama-quantize --allow-requantize "
              "of the Q4_K_M files (every tensor dequantized). Saguaro loads the Q4_K_M files, dequantizes to bf16, "
              "and re-quantizes its draft to its own int4 format (groups of 32) with a "
              f"{args.draft_vocab or 'full'}-token head."]
    loads = [s["loadavg_1m_after"] for s in summaries.values() if s.get("loadavg_1m_after") is not None]
    if loads:
        shared = ("above 1 per core: other work shared the cores and slowed the rows" if max(loads) > cpu["cores"]
                  else "at most 1 per core: nothing else competed for the cores")
        lines += ["", f"1-minute load average after each row: {min(loads):.1f}-{max(loads):.1f} on "
                  f"{cpu['cores']} cores ({shared})."]
    counted = {k: ", ".join(f"{r['prompt_tokens']}/{r['prompt_tokens_ours']}" for r in runs)
               for k, runs in llama_runs.items()}
    if counted:
        lines += ["", "Prompt tokens, as llama.cpp's timing lines count them / as Saguaro fed them: "
                  + "; ".join(f"{k} {v}" for k, v in counted.items()) + "."]
    payload = {"benchmark": "peers", "description": __doc__.split("\n\n")[0], "cpu": cpu, "threads": args.threads,
               "versions": versions, "models": {"target": args.target, "draft": args.draft},
               "files": {k: {"path": str(p), "bytes": Path(p).stat().st_size} for k, p in files.items()},
               "settings": settings(args), "environment": environment(), "labels": labels, "commands": commands,
               "summary": summaries, **ratios, "llama_cpp_requests": llama_runs}
    return payload, "\n".join(lines)


def same_text(llama_runs: list[dict[str, Any]], records: list[Any]) -> tuple[int, int]:
    """(greedy outputs of a llama.cpp row equal to Saguaro AR's as text, how many were compared)."""
    ours = {(r.dataset, r.prompt_index): r.text.strip() for r in records}
    pairs = [(run["text"].replace("[end of text]", "").strip(), ours[(run["dataset"], run["prompt_index"])])
             for run in llama_runs if (run["dataset"], run["prompt_index"]) in ours]
    return sum(a == b for a, b in pairs), len(pairs)


def prepare_llama(args: argparse.Namespace, rows: list[Row]) -> tuple[lc.Build, dict[str, Path]]:
    """The build (made or reused) and the GGUF files of the llama.cpp rows."""
    build = lc.build_location() if args.skip_build else lc.ensure_built(jobs=args.jobs, log=log)
    if not build.complete():
        raise lc.PeerRunError(f"no llama.cpp build at {build.build}: run without --skip-build to build it")
    keys = {k for r in rows for k in (r.target, r.draft) if k}
    return build, {k: p for k, p in model_files(build, keys).items() if k in keys}


def llama_memory(build: lc.Build, prompt: Prompt, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """llama.cpp's memory rows (peer_memory.py): llama-completion on the 1.5B BF16 and Q4_K_M files, 8 tokens."""
    files = model_files(build, {key for _, _, key in LLAMA_MEMORY_ROWS})
    with tempfile.TemporaryDirectory(prefix="saguaro-peers-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(prompt.chat)
        commands = {key: lc.completion_command(build, files[file], prompt_file, MEMORY_TOKENS, args.threads)
                    for key, _, file in LLAMA_MEMORY_ROWS}
        return measure_llama(commands, args.timeout, list(range(args.threads)), log)


@dataclass
class Results:
    """What the rows measured so far (written after every row, so a stopped run keeps the rows it finished)."""
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    llama_runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    records: dict[str, list[Any]] = field(default_factory=dict)
    commands: dict[str, Any] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)  # Saguaro rows this machine cannot run, and why
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)  # --memory: peer_memory.py's rows
    prefill: dict[str, Any] = field(default_factory=dict)  # --prefill: peer_prefill.py's rows


def run_row(r: Row, build: lc.Build | None, files: dict[str, Path], prompts: list[Prompt], labels: dict[str, str],
            args: argparse.Namespace, res: Results) -> None:
    import shlex
    if r.engine == LLAMA:
        assert build is not None
        res.llama_runs[r.key] = run_llama(r, build, files, prompts, args)
        res.summaries[r.key] = summarize_llama(res.llama_runs[r.key])
        res.commands[r.key] = shlex.join(llama_command(r, build, files, Path("PROMPT.txt"), args))
    else:
        options = saguaro_options(r, args)
        try:
            res.records[r.key] = run_engine(labels[r.key], options, prompts, args)
        except (ValueError, RuntimeError) as e:  # e.g. a draft format this CPU has no kernels for
            log(f"{r.key}: not run: {e}")
            res.not_run[r.key] = str(e)
            return
        res.summaries[r.key] = summarize_records(res.records[r.key])
        res.commands[r.key] = options
    res.summaries[r.key]["loadavg_1m_after"] = os.getloadavg()[0]  # the machine may be shared: say how busy


def write(args, labels, res: Results, files, versions, left: list[str]) -> str:
    done = [r for r in ROWS if r.key in res.summaries]  # table order
    payload, markdown = report(args, done, labels, res.summaries, res.llama_runs, res.commands, files,
                               cpu_description(), versions)
    if "llama-bf16-ar" in res.llama_runs and "saguaro-ar" in res.records:
        equal, compared = same_text(res.llama_runs["llama-bf16-ar"], res.records["saguaro-ar"])
        payload["greedy_text_equal_llama_bf16_ar_vs_saguaro_ar"] = {"equal": equal, "compared": compared}
        markdown += (f"\n\nGreedy output text of llama.cpp 1.5B BF16 AR equal to Saguaro AR's: {equal}/{compared} "
                     "(bf16 on both sides; an argmax tie may round differently).")
    if res.not_run:
        payload["rows_failed"] = res.not_run
        markdown += "\n\n" + "\n".join(f"Not run here: {labels[k]}: {why}" for k, why in res.not_run.items())
    if left:
        payload["rows_not_run"] = left
        markdown += f"\n\nPartial: rows not run yet: {', '.join(left)}."
    if res.memory:
        payload["memory"] = res.memory
        markdown += "\n\n" + memory_table(res.memory)
    if res.prefill:
        payload["prefill"] = res.prefill
        markdown += "\n\n" + peer_prefill.prefill_table(res.prefill, payload["cpu"])
    payload["saguaro_requests"] = [rec.to_json() for recs in res.records.values() for rec in recs]
    write_results(args.out, "bench_peers", payload, markdown)
    return markdown


def main(argv: list[str] | None = None) -> int:
    import torch
    args = parse_args(argv)
    rows = [r for r in ROWS if r.key in args.only]
    llama_rows = [r for r in rows if r.engine == LLAMA]
    if llama_rows and (args.target, args.draft) != (TARGET, DRAFT):
        print("error: the llama.cpp rows run the registry's GGUF pair; --target / --draft choose the Saguaro rows' "
              "models only (add --only saguaro)", file=sys.stderr)
        return 2
    try:
        build, files = prepare_llama(args, llama_rows) if llama_rows else (None, {})
    except (lc.ToolchainError, lc.PeerRunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return lc.EXIT_NO_TOOLCHAIN if isinstance(e, lc.ToolchainError) else 1
    from saguaro.loading import load_tokenizer
    prompts = prepare_prompts(load_tokenizer(args.target, progress=False), args.datasets, args.prompts)
    labels = {r.key: (llama_label if r.engine == LLAMA else saguaro_label)(r, args) for r in rows}
    built = lc.tool_version(build) if build is not None else None
    versions = {"llama_cpp": f"{lc.PACKAGE}=={lc.VERSION} sdist (vendor/llama.cpp)" + (f", {built}" if built else ""),
                "saguaro_commit": environment()["git_commit"], "torch": torch.__version__}
    res = Results()
    log(f"{len(prompts)} prompts x {len(rows)} configurations, {args.max_tokens} new tokens each")
    # run order: each Saguaro row next to its llama.cpp peers, so a run stopped early still compares something
    rows = sorted(rows, key=lambda r: RUN_ORDER.index(r.key))
    for i, r in enumerate(rows):
        try:
            run_row(r, build, files, prompts, labels, args, res)
        except lc.PeerRunError as e:
            print(f"error: {r.key}: {e}", file=sys.stderr)
            return 1
        markdown = write(args, labels, res, files, versions, [x.key for x in rows[i + 1:]])
    if args.memory:
        ssd = saguaro_options(next(r for r in ROWS if r.key == "saguaro-ssd"), args)
        res.memory = measure_memory(args.target, ssd, prompts[0].ids, args.timeout, log)
        if build is not None:  # llama.cpp runs here: its rows beside Saguaro's
            res.memory.update(llama_memory(build, prompts[0], args))
        markdown = write(args, labels, res, files, versions, [])
    if args.prefill:
        parents = {r.key: saguaro_options(r, args) for r in rows if r.engine == SAGUARO}
        def finished(result: dict[str, Any]) -> None:
            res.prefill = result
            write(args, labels, res, files, versions, [])
        peer_prefill.measure(args, build, lambda keys: model_files(build, keys), parents, log, finished)
        markdown = write(args, labels, res, files, versions, [])
    print(markdown)
    log(f"wrote {args.out / 'bench_peers.json'} and {args.out / 'bench_peers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
