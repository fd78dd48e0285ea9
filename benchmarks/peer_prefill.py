"""Prompt processing (time to first token) beside llama.cpp: the table ``saguaro bench peers --prefill`` adds.

The same text for both engines, per prompt length N: real prompts (HumanEval and MT-Bench, the benches' datasets)
joined and repeated, and a window of exactly N tokens of the model's tokenizer cut from them that survives the
trip through text (decoding the N ids and encoding the text gives the same N ids), so what llama.cpp reads from
its prompt file is what Saguaro is given as ids. The window's text never ends in a newline (llama.cpp drops one
from a prompt file).

Rates, prompt tokens per second:
  - llama.cpp: its own "prompt eval time = T ms / M tokens" line of ``llama-completion -n 1 -c N+16`` (M / T;
    M is what it counted, reported beside N);
  - Saguaro: N over the time to first token of a request of ``max_tokens=1`` (the prompt pass and the first
    token's sampling), after a short warm-up request; one ``LLM`` per row, with bench peers' threads and pinning
    and a context of the longest prompt plus 16.
Rows: llama.cpp on bench peers' 1.5B BF16 and Q4_K_M files, Saguaro AR with a bf16 and an int4 target; with the
default target also SmolLM2-135M (the registry's Q4_1 GGUF): llama.cpp on that file, Saguaro bf16 and int4.
x llama.cpp: Saguaro's rate over llama.cpp's on the same weights (bf16: BF16, int4: Q4_K_M; SmolLM2's int4
against its Q4_1 file: 4 bits both, not the same format). A length beyond a model's context is skipped.
"""
from __future__ import annotations

import argparse
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from benchmarks import llama_cpp as lc
from benchmarks.common import TARGET, fmt, int_list, ratio, table

LLAMA, SAGUARO = "llama.cpp", "saguaro"
SMOL = "smollm2-135m"
HEADROOM = 16  # context beyond the prompt: llama-completion refuses a prompt above its context minus 4
WARMUP_TOKENS = 32
SOURCE = ("humaneval", "mtbench")


@dataclass(frozen=True)
class PrefillRow:
    """One configuration of the prefill table."""
    key: str
    engine: str  # LLAMA or SAGUARO
    label: str
    model: str  # "target": bench peers' --target; else a registry name
    weights: str  # Saguaro: its target_weights; llama.cpp: bench peers' file key, or "registry" (the model's file)
    parent: str  # the bench peers row (--only) that brings this one in
    peer: str | None = None  # the llama.cpp row of the same weights: the ratio's denominator


PREFILL_ROWS = (
    PrefillRow("prefill-llama-bf16", LLAMA, "llama.cpp, 1.5B BF16", "target", "target-bf16", "llama-bf16-ar"),
    PrefillRow("prefill-saguaro-bf16", SAGUARO, "Saguaro AR, 1.5B bf16", "target", "bf16", "saguaro-ar",
               "prefill-llama-bf16"),
    PrefillRow("prefill-llama-q4", LLAMA, "llama.cpp, 1.5B Q4_K_M", "target", "target-q4", "llama-q4-ar"),
    PrefillRow("prefill-saguaro-int4", SAGUARO, "Saguaro AR, 1.5B int4", "target", "int4", "saguaro-q4-ar",
               "prefill-llama-q4"),
    PrefillRow("prefill-llama-smol", LLAMA, "llama.cpp, SmolLM2-135M Q4_1", SMOL, "registry", "llama-q4-ar"),
    PrefillRow("prefill-saguaro-smol-bf16", SAGUARO, "Saguaro AR, SmolLM2-135M bf16", SMOL, "bf16", "saguaro-ar"),
    PrefillRow("prefill-saguaro-smol-int4", SAGUARO, "Saguaro AR, SmolLM2-135M int4", SMOL, "int4", "saguaro-q4-ar",
               "prefill-llama-smol"),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int_list, default=[],
                   help="also a prompt-processing table at these prompt lengths, e.g. 512,2048,8192 "
                        "(benchmarks/peer_prefill.py)")
    p.add_argument("--prefill-chunk", type=chunk_setting, default="auto",
                   help="Saguaro's max_prefill_tokens in the prefill rows (default auto, the engine's default)")


def chunk_setting(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if any(n < 1 for n in args.prefill):
        p.error("--prefill lengths must be at least 1 token")
    if args.prefill and not chosen_rows(args.only, args.target, llama=True):
        p.error("--prefill needs one of the rows " + ", ".join(sorted({r.parent for r in PREFILL_ROWS}))
                + " in --only")


def chosen_rows(only: Iterable[str], target: str, llama: bool) -> list[PrefillRow]:
    """The rows bench peers' selection brings in (SmolLM2's beside the default target only)."""
    only = set(only)
    return [r for r in PREFILL_ROWS if r.parent in only and (r.engine == SAGUARO or llama)
            and (r.model == "target" or target == TARGET)]


def row_label(row: PrefillRow, target: str) -> str:
    """The row's label, naming the target where it is not the default 1.5B."""
    return row.label.replace("1.5B", Path(target).name) if row.model == "target" and target != TARGET else row.label


# -- the prompts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillPrompt:
    """A prompt of exactly ``len(ids)`` tokens and the text they decode to (which encodes back to them)."""
    ids: list[int]
    text: str
    start: int  # where the window begins in the repeated source's tokens


def source_text(names: Iterable[str] = SOURCE) -> str:
    """Real prompts joined: every prompt of each dataset."""
    from saguaro import datasets as ds
    return "\n\n".join(t for name in names for t in ds.load(name))


def build_prompt(tokenizer: Any, text: str, n: int, tries: int = 256) -> PrefillPrompt:
    """The first window of ``n`` tokens of ``text`` (repeated as needed) whose text encodes back to the same ids
    and does not end in a newline. Deterministic: the same tokenizer and text give the same prompt."""
    if n < 1:
        raise ValueError(f"a prompt needs at least 1 token, got {n}")
    once = len(tokenizer.encode(text, add_special_tokens=False))
    if once == 0:
        raise ValueError("the source text has no tokens")
    ids = tokenizer.encode("\n\n".join([text] * (-(-(n + tries) // once) + 1)), add_special_tokens=False)
    for start in range(tries):
        window = ids[start:start + n]
        decoded = tokenizer.decode(window)
        if not decoded.endswith("\n") and tokenizer.encode(decoded, add_special_tokens=False) == window:
            return PrefillPrompt(window, decoded, start)
    raise ValueError(f"no window of {n} tokens in the first {tries} positions encodes back to itself")


# -- the runs ---------------------------------------------------------------------------------------
def gguf_context(path: Path) -> int | None:
    """The context length a GGUF file declares (``<arch>.context_length``), or None."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    arch = reader.fields.get("general.architecture")
    field = reader.fields.get(f"{bytes(arch.parts[-1]).decode()}.context_length") if arch else None
    return int(field.parts[-1][0]) if field else None


def run_llama(build: lc.Build, model: Path, prompts: dict[int, PrefillPrompt], threads: int,
              timeout: float) -> dict[int, dict[str, Any]]:
    """One ``llama-completion -n 1`` per length, a fresh process each: its prompt-eval line."""
    context, runs = gguf_context(model), {}
    with tempfile.TemporaryDirectory(prefix="saguaro-prefill-") as tmp:
        for n, p in prompts.items():
            if context is not None and n >= context:
                runs[n] = {"skipped": f"beyond the model's context ({context})"}
                continue
            prompt_file = Path(tmp) / f"prompt-{n}.txt"
            prompt_file.write_text(p.text, encoding="utf-8")
            cmd = lc.completion_command(build, model, prompt_file, 1, threads, context=n + HEADROOM)
            stdout, stderr = lc.run_tool(cmd, timeout, cores=list(range(threads)))
            pe = lc.parse_prompt_eval(stdout + "\n" + stderr)
            runs[n] = {"prompt_tokens": pe.tokens, "seconds": pe.seconds, "tok_s": pe.tok_s,
                       "same_count": pe.tokens == n, "command": shlex.join(cmd)}
    return runs


def run_saguaro(model: str, options: dict[str, Any], prompts: dict[int, PrefillPrompt]) -> dict[int, dict[str, Any]]:
    """Every length through one LLM, after a warm-up request: N over the time to first token."""
    from saguaro import LLM, SamplingParams
    once = SamplingParams(temperature=0.0, max_tokens=1)
    runs: dict[int, dict[str, Any]] = {}
    with LLM(target=model, **options) as llm:
        llm.generate([prompts[min(prompts)].ids[-WARMUP_TOKENS:]], once)
        for n, p in prompts.items():
            if n >= llm.max_model_len:
                runs[n] = {"skipped": f"beyond the model's context ({llm.max_model_len})"}
                continue
            ttft = llm.generate([p.ids], once)[0].timings.ttft_s
            runs[n] = {"prompt_tokens": n, "seconds": ttft, "tok_s": n / ttft if ttft > 0 else None}
    return runs


def saguaro_options(parent: dict[str, Any], row: PrefillRow, longest: int, chunk: int | str) -> dict[str, Any]:
    """bench peers' AR options of the parent row, with a context that holds the longest prompt."""
    context = longest + HEADROOM
    return dict(parent, target_weights=row.weights, max_model_len=context,
                kv_cache_tokens=max(context, parent.get("kv_cache_tokens", 0)), max_prefill_tokens=chunk)


def measure(args: argparse.Namespace, build: lc.Build | None, files_for: Callable[[set[str]], dict[str, Path]],
            parents: dict[str, dict[str, Any]], log: Callable[[str], None] = print,
            finished: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every chosen row at every length of ``args.prefill``, each llama.cpp row next to its Saguaro peer.
    ``files_for``: bench peers' GGUF files by key; ``parents``: bench peers' Saguaro options by row key;
    ``finished``: called with the rows so far after each row (a run stopped early keeps them)."""
    from saguaro.loading import load_tokenizer
    from saguaro.loading.registry import asset_path, resolve
    rows = chosen_rows(args.only, args.target, llama=build is not None)
    text, lengths = source_text(), sorted(set(args.prefill))
    models = {m: args.target if m == "target" else m for m in dict.fromkeys(r.model for r in rows)}
    prompts = {m: {n: build_prompt(load_tokenizer(name, progress=False), text, n) for n in lengths}
               for m, name in models.items()}
    files = files_for({r.weights for r in rows if r.engine == LLAMA and r.weights != "registry"}) if build else {}
    out: dict[str, Any] = {"lengths": lengths, "prefill_chunk": args.prefill_chunk, "threads": args.threads,
                           "models": models, "rows": {}}
    for r in rows:
        log(f"prefill: {r.key}")
        entry: dict[str, Any] = {"label": row_label(r, args.target), "engine": r.engine, "model": models[r.model],
                                 "peer": r.peer}
        try:
            if r.engine == LLAMA:
                assert build is not None
                path = asset_path(resolve(r.model), progress=False) if r.weights == "registry" else files[r.weights]
                entry.update(file=str(path), runs=run_llama(build, path, prompts[r.model], args.threads, args.timeout))
            else:
                options = saguaro_options(parents[r.parent], r, lengths[-1], args.prefill_chunk)
                entry.update(options=options, runs=run_saguaro(models[r.model], options, prompts[r.model]))
        except (lc.PeerRunError, ValueError, RuntimeError) as e:
            log(f"prefill: {r.key}: not run: {e}")
            entry["error"] = str(e)
        entry["loadavg_1m_after"] = os.getloadavg()[0]
        log(f"prefill: {r.key}: " + ", ".join(f"{n} tokens {fmt(run.get('tok_s'), '.1f')} tok/s"
                                              for n, run in entry.get("runs", {}).items()))
        out["rows"][r.key] = entry
        finished(out)
    return out


# -- the table ---------------------------------------------------------------------------------------
def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[int, float | None]]:
    """Each row with a peer: its rate over the peer's, per length both measured."""
    def rate(key: str | None, n: int) -> float | None:
        return rows.get(key or "", {}).get("runs", {}).get(n, {}).get("tok_s")
    return {key: {n: ratio(rate(key, n), rate(row["peer"], n)) for n in row.get("runs", {})}
            for key, row in rows.items() if row.get("peer")}


def prefill_table(result: dict[str, Any], cpu: dict[str, Any]) -> str:
    """The Markdown of the prefill rows: one line per length and row."""
    rows, x = result["rows"], ratios(result["rows"])
    lines = []
    for n in result["lengths"]:
        for key, row in rows.items():
            run = row.get("runs", {}).get(n)
            if run is None or "skipped" in run:
                lines.append([n, row["label"], "-", "-", "-", (run or {}).get("skipped", row.get("error", "-"))])
                continue
            lines.append([n, row["label"], fmt(run["tok_s"], ".1f"), fmt(run["seconds"], ".3f"),
                          fmt(x.get(key, {}).get(n)), run["prompt_tokens"]])
    loads = [r["loadavg_1m_after"] for r in rows.values() if r.get("loadavg_1m_after") is not None]
    other = [f"{row['label']} at {n}: {run['prompt_tokens']}" for row in rows.values()
             for n, run in row.get("runs", {}).items() if run.get("same_count") is False]
    threads = result["threads"]
    return ("Prompt processing: prompt tokens per second at each length (benchmarks/peer_prefill.py). The same "
            "text for both engines: HumanEval and MT-Bench prompts joined and repeated, a window of exactly N "
            "tokens of the model's tokenizer. llama.cpp: its own prompt-eval line of `llama-completion -n 1 "
            "-c N+16`; Saguaro: N over the time to first token of a request of one token, after a warm-up "
            f"request (max_prefill_tokens {result['prefill_chunk']}). x llama.cpp: Saguaro over llama.cpp on the "
            "same weights (bf16: BF16, int4: Q4_K_M; SmolLM2 int4: its Q4_1 file). tokens: as the engine counted "
            f"them. CPU: {cpu['summary']}; {threads} thread{'s' if threads > 1 else ''} per engine, pinned"
            + (f"; 1-minute load average after each row {min(loads):.1f}-{max(loads):.1f} on {cpu['cores']} cores"
               if loads else "") + "."
            + (f" llama.cpp counted another number of prompt tokens: {'; '.join(other)}." if other else "")
            + "\n\n"
            + table(["prompt tokens", "config", "tok/s", "s", "x llama.cpp", "tokens"], lines))
