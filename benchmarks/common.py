"""Shared pieces of the benchmark scripts: prompts, engine options, timed runs, summaries, tables, files.

A benchmark is a list of configurations, each run over the same prompts one request at a
time (batch 1: latency). Each request gives a ``Record``; records are grouped by temperature
and dataset and summarized with medians over prompts (decode tok/s) and pooled speculation
counters (acceptance, tokens per round, p_hit). Ratios are always taken against a
configuration measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from saguaro import datasets as ds
from saguaro.config import WORKLOADS
from saguaro.engine.metrics import summarize
from saguaro.models.draft_format import WEIGHT_FORMATS
from saguaro.sampling.params import SamplingParams

TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
HUMANEVAL_INSTRUCTION = "Complete this Python function:\n\n"  # as in saguaro/demo.py
ALL = "all"  # the group of every dataset together

_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress line on stderr, with the time since the script started."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


# -- arguments ---------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_fan_out(spec: str, k: int) -> tuple[list[int] | str, int | str | None]:
    """One SSD fan-out spec -> (fan_out, branch_steps): "auto", "uniform" (1 per depth), "lastN" (1 per
    depth, N for the all-accepted outcome) or counts "F_0,...,F_K"; a suffix "@S" (or "@auto") tapers the
    tree after S build steps."""
    spec, _, steps = spec.strip().partition("@")
    if spec == "uniform":
        f: list[int] | str = [1] * (k + 1)
    elif spec.startswith("last"):
        f = [1] * k + [int(spec[4:])]
    elif spec == "auto":
        f = "auto"
    else:
        f = int_list(spec)
    return f, (steps if steps == "auto" else int(steps)) if steps else None


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--target`` and ``--draft``: the pair a benchmark runs (default the Qwen pair its figures are for)."""
    p.add_argument("--target", default=TARGET, help=f"registry name, .gguf file or HF directory (default {TARGET})")
    p.add_argument("--draft", default=DRAFT, help=f"the draft model, sharing the target's vocabulary (default {DRAFT})")


def add_common_args(p: argparse.ArgumentParser, *, prompts: int = 2, max_tokens: int = 64,
                    temperatures: str = "0,1", datasets: str = "humaneval,mtbench") -> None:
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=prompts, help=f"prompts per dataset (default {prompts})")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens per request (default {max_tokens})")
    p.add_argument("--datasets", type=str_list, default=str_list(datasets),
                   help=f"comma separated, from {', '.join(ds.SUBSTITUTES)} (default {datasets})")
    p.add_argument("--temperatures", type=float_list, default=float_list(temperatures),
                   help=f"comma separated; 0 is greedy, >0 is seeded sampling (default {temperatures})")
    p.add_argument("--seed", type=int, default=1234, help="base seed of sampled requests (prompt i uses seed+i)")
    p.add_argument("--enforce-eager", action="store_true", help="run the engine's eager reference (slow)")
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # deprecated: the fast path is default
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="draft weight format for SD and SSD (default bf16)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the draft head keeps token ids below this, plus special tokens (default: all)")
    p.add_argument("--calibration-workload", choices=WORKLOADS, default="mixed",
                   help="which calibration profile 'auto' settings read (saguaro calibrate --workload)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="tokens of one warm-up request per engine (0: none)")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for the JSON and Markdown files")


# -- prompts and engine options -----------------------------------------------------
@dataclass
class Prompt:
    dataset: str
    index: int
    text: str  # the raw dataset prompt
    ids: list[int]  # chat-templated token ids, what every configuration receives
    chat: str = ""  # the same chat-templated prompt as text (for programs that tokenize it themselves)


def prepare_prompts(tokenizer: Any, names: Iterable[str], n: int) -> list[Prompt]:
    """The first ``n`` prompts of each dataset, wrapped in the chat template (instruct models)."""
    prompts = []
    for name in names:
        texts = ds.load(name, n)
        wrapped = [HUMANEVAL_INSTRUCTION + t if name == "humaneval" else t for t in texts]
        chats = ds.chat_texts(tokenizer, wrapped)
        for i, (text, ids, chat) in enumerate(zip(texts, ds.as_chat(tokenizer, wrapped), chats)):
            prompts.append(Prompt(name, i, text, ids, chat))
    return prompts


def dataset_labels(names: Iterable[str]) -> dict[str, str]:
    return {n: ds.SUBSTITUTES.get(n, n) for n in names}


def engine_options(enforce_eager: bool = False, threads: int = 1, target_cores: Iterable[int] = (0,),
                   draft_cores: Iterable[int] = (1,)) -> dict[str, Any]:
    """LLM options shared by every configuration: bf16, pinned cores, a 4k context."""
    return dict(dtype="bfloat16", enforce_eager=enforce_eager, threads=threads, target_cores=list(target_cores),
                draft_cores=list(draft_cores), max_model_len=4096, kv_cache_tokens=8192)


def draft_options(args: argparse.Namespace) -> dict[str, Any]:
    """The draft format options (int8/int4 weights, reduced head) of every SD and SSD configuration, and the
    calibration profile their "auto" settings read."""
    return dict(draft_weights=args.draft_weights, draft_vocab=args.draft_vocab,
                calibration_workload=args.calibration_workload)


def sampling_params(temperature: float, max_tokens: int, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=None if temperature == 0 else seed)


# -- runs ----------------------------------------------------------------------------
@dataclass
class Record:
    """One request of one configuration."""
    config: str
    dataset: str
    prompt_index: int
    temperature: float
    tok_s: float  # decode tokens per second (tokens after the first, over the time after the first)
    ttft_s: float
    total_s: float
    new_tokens: int
    finish_reason: str
    token_ids: list[int]
    text: str = ""
    spec: Any = None  # raw per-request speculation counters (SpeculationCounts); pooled by summarize()
    rounds: list[dict] = field(default_factory=list)  # per-round timings (see rounds.py)
    extra: dict = field(default_factory=dict)

    def to_json(self, with_rounds: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("spec")
        reports_cache = self.extra.get("reports_cache", False)
        d["spec"] = None if self.spec is None else asdict(summarize([self.spec], reports_cache))
        if not with_rounds:
            d.pop("rounds")
        return d


def run_requests(llm: Any, config: str, prompts: list[Prompt], temperatures: list[float], max_tokens: int,
                 seed: int, rounds: Any = None, warmup_tokens: int = 4) -> list[Record]:
    """Every prompt at every temperature, one request at a time, after one short warm-up request.

    ``rounds`` (optional) is a round log with ``len()`` and ``slice(i0, i1)`` (rounds.py); each
    record gets the rounds its request took.
    """
    if warmup_tokens > 0:
        llm.generate([prompts[0].ids], SamplingParams(max_tokens=warmup_tokens))
    reports_cache = bool(getattr(llm.engine.decoder, "reports_cache", False))
    decoder = llm.engine.decoder
    lanes = getattr(getattr(decoder, "link", None), "lanes", None)  # a speculator thread's GPU arrangement
    records = []
    for temperature in temperatures:
        for p in prompts:
            i0 = len(rounds) if rounds is not None else 0
            out = llm.generate([p.ids], sampling_params(temperature, max_tokens, seed + p.index))[0]
            t = out.timings
            records.append(Record(
                config, p.dataset, p.index, temperature, t.decode_tokens_per_s, t.ttft_s, t.total_s,
                len(out.token_ids), out.finish_reason, list(out.token_ids), out.text,
                out.spec_counts if out.spec is not None else None,
                rounds.slice(i0, len(rounds)) if rounds is not None else [],
                # SSD whose speculator failed finished with n-gram SD: the record says so, never passes as SSD
                {"reports_cache": reports_cache, "speculator_failure": getattr(decoder, "failure", None),
                 "lanes": None if lanes is None else asdict(lanes)}))
            log(f"  {config} | {p.dataset}[{p.index}] T={temperature:g}: {len(out.token_ids)} tokens, "
                f"{t.decode_tokens_per_s:.2f} tok/s" + (f", acceptance {out.spec.acceptance_rate:.2f}"
                                                        if out.spec is not None else ""))
    return records


def run_engine(config: str, options: dict[str, Any], prompts: list[Prompt], args: argparse.Namespace,
               temperatures: list[float] | None = None, target: Any = None) -> list[Record]:
    """Build one LLM (on ``target``: a name or a ``LoadedModel``; default ``args.target``), run every request
    through it, close it (SSD owns a worker process or thread)."""
    from saguaro import LLM
    from benchmarks.rounds import round_log

    log(f"{config}: loading")
    with LLM(target=args.target if target is None else target, **options) as llm:
        graphs = getattr(llm.engine.target.backend, "graphs", None)
        if graphs is not None and graphs.sealed:
            log(f"{config}: {len(graphs.graphs)} target CUDA graphs captured at start-up, {graphs.capture_s:.1f} s")
        records = run_requests(llm, config, prompts, temperatures or args.temperatures, args.max_tokens,
                               args.seed, round_log(llm.engine.decoder), args.warmup_tokens)
    gc.collect()
    if speculator_failure(records):
        log(f"{config}: FAILED: SSD fell back to n-gram SD: {speculator_failure(records)}")
    return records


def speculator_failure(records: Iterable[Record]) -> str | None:
    """Why the SSD speculator of these records failed (they then ran n-gram SD, not SSD), or None."""
    return next((r.extra["speculator_failure"] for r in records if r.extra.get("speculator_failure")), None)


def failed_configs(records: dict[str, list[Record]]) -> dict[str, str]:
    """Configuration -> why its speculator failed, for those that failed: a benchmark with any exits non-zero."""
    return {name: reason for name, recs in records.items() if (reason := speculator_failure(recs))}


# -- summaries -------------------------------------------------------------------------
def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def temp_key(temperature: float) -> str:
    return f"T={temperature:g}"


def pool_rounds(rounds: list[dict]) -> dict[str, float | None]:
    """Median and mean of every numeric per-round field, pooled over all rounds given."""
    keys = [k for k in (rounds[0] if rounds else {}) if k.endswith("_ms") or k in ("build_steps", "drafted")]
    out: dict[str, float | None] = {"rounds_timed": len(rounds)}
    for key in keys:
        vals = [r.get(key) for r in rounds]
        out[f"{key}_median"] = median(vals)
        out[f"{key}_mean"] = mean(vals)
    return out


def summarize_records(records: list[Record]) -> dict[str, Any]:
    """Median tok/s over requests; speculation counters pooled over requests; round timings pooled."""
    d: dict[str, Any] = {
        "requests": len(records),
        "tok_s_median": median(r.tok_s for r in records),
        "tok_s_min": min((r.tok_s for r in records), default=None),
        "tok_s_max": max((r.tok_s for r in records), default=None),
        "ttft_s_median": median(r.ttft_s for r in records),
        # the whole request, prefill included: what a user waits for (a draft prefill moved out of the
        # decode window still counts here)
        "e2e_tok_s_median": median(r.new_tokens / r.total_s for r in records if r.total_s > 0),
        "new_tokens": sum(r.new_tokens for r in records),
        "speculator_failure": speculator_failure(records),
    }
    specs = [r.spec for r in records if r.spec is not None]
    if specs:
        m = summarize(specs, any(r.extra.get("reports_cache") for r in records))
        d.update(rounds=m.rounds, acceptance_rate=m.acceptance_rate, mean_accepted_length=m.mean_accepted_length,
                 tokens_per_round=m.tokens_per_round, acceptance_by_position=m.acceptance_by_position,
                 p_hit=m.cache_hit_rate, p_hit_after_hit=m.hit_rate_after_hit,
                 p_hit_after_miss=m.hit_rate_after_miss)
    forwards = [r.extra.get("target_forwards") for r in records]
    if all(f for f in forwards) and records:  # transformers: no counters, only target forward calls
        d["rounds"] = sum(forwards)
        d["tokens_per_round"] = d["new_tokens"] / d["rounds"]
        d["mean_accepted_length"] = d["tokens_per_round"] - 1
    d.update(pool_rounds([x for r in records for x in r.rounds]))
    return d


def group_records(records: list[Record]) -> dict[str, dict[str, dict[str, Any]]]:
    """{"T=0": {"humaneval": summary, ..., "all": summary}, ...}"""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for temperature in dict.fromkeys(r.temperature for r in records):
        at_t = [r for r in records if r.temperature == temperature]
        groups = {name: [r for r in at_t if r.dataset == name] for name in dict.fromkeys(r.dataset for r in at_t)}
        groups[ALL] = at_t
        out[temp_key(temperature)] = {name: summarize_records(recs) for name, recs in groups.items()}
    return out


def same_tokens(records: list[Record], reference: list[Record]) -> tuple[int, int]:
    """(how many greedy requests produced exactly the reference's tokens, how many were compared)."""
    ref = {(r.dataset, r.prompt_index): r.token_ids for r in reference if r.temperature == 0}
    pairs = [(r.token_ids, ref[(r.dataset, r.prompt_index)]) for r in records
             if r.temperature == 0 and (r.dataset, r.prompt_index) in ref]
    return sum(a == b for a, b in pairs), len(pairs)


# -- tables and files -------------------------------------------------------------------
def fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown pipe table, padded so it also reads well as plain text."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, core count, load (this machine may be shared)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": commit,
    }


def command_line() -> str:
    """How this script was started, to put next to its numbers."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_results(out_dir: Path, name: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    payload = {"command": command_line(), **payload}
    json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + f"\n\nCommand: `{payload['command']}`\n")
    return json_path, md_path

