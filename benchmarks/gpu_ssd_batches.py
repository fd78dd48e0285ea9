"""SSD, SD and AR with several requests at once (``bench gpu --mode ssd --batches 1,8,32``).

Batch 1 is ``bench_gpu_ssd``'s main table (per-round anatomy, Thm 2). Here every configuration of that table runs
B requests together, once per batch size B > 1, on B prompts of the same kind:

    tok/s        all requests' decode tokens (each request's tokens after its first) over the longest decode
    per request  the median request's decode tokens per second
    xAR, xSD     against AR's and the best SD's all-request tok/s at the same batch size and temperature
    accept       accepted / drafted tokens over the batch; p_hit: the cache-hit rate of SSD's rounds

Every prompt prefills in one step, so the decode timed is decoding alone (a prefill step chunked among the decode
steps would be timed with them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.bench_gpu import batch_rates
from benchmarks.build_counters import build_kind
from benchmarks.common import fmt, log, ratio, sampling_params, table, temp_key
from benchmarks.synthetic import prompts
from saguaro import LLM, SamplingParams


@dataclass
class BatchRow:
    name: str
    mode: str
    batch: int
    temperature: float
    tok_s: float | None  # all requests together
    per_request_tok_s: float | None  # the median request's
    acceptance: float | None
    p_hit: float | None
    tokens_per_round: float | None
    failure: str | None = None  # SSD whose speculator failed ran n-gram SD: its figures are not SSD's


def measure_batches(args, target, configs, base: dict[str, Any], priorities) -> list[BatchRow]:
    """Every configuration (``bench_gpu_ssd.configurations``) at each batch size of ``args.batches`` above 1.
    ``priorities``: ``bench_gpu_ssd.stream_priorities``."""
    rows = []
    longest = args.prompt_len + args.max_tokens + 16
    for batch in sorted(b for b in set(args.batches) if b > 1):
        ids = prompts(target.config.vocab_size, batch, args.prompt_len, seed=args.seed + batch)
        options = dict(base, max_num_seqs=batch, kv_cache_tokens=batch * longest * 2 + 1024,
                       max_prefill_tokens=batch * args.prompt_len)
        for name, mode, _, _, extra, build, priority in configs:
            with build_kind(build == "graph", args.paged), priorities(priority):
                log(f"{name}, batch {batch}: loading")
                with LLM(target=target, **dict(options, mode=mode, **extra)) as llm:
                    llm.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
                    for t in args.temperatures:
                        rows.append(_run(llm, name, mode, batch, t, ids, args))
                        log(f"  {name}, batch {batch}, T={t:g}: {fmt(rows[-1].tok_s, '.1f')} tok/s")
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _run(llm, name: str, mode: str, batch: int, temperature: float, ids: list[list[int]], args) -> BatchRow:
    params = []
    for i in range(batch):
        p = sampling_params(temperature, args.max_tokens, args.seed + i)
        p.ignore_eos = True  # every request decodes max_tokens: the batch stays full
        params.append(p)
    outs = llm.generate(ids, params)
    spec = llm.spec_metrics(outs)
    tok_s, per_request, _ = batch_rates(outs)
    return BatchRow(name, mode, batch, temperature, tok_s, per_request,
                    spec.acceptance_rate if spec is not None else None,
                    spec.cache_hit_rate if spec is not None and mode == "ssd" else None,
                    spec.tokens_per_round if spec is not None else None,
                    getattr(llm.engine.decoder, "failure", None))


def batch_tables(rows: list[BatchRow]) -> list[str]:
    """One markdown table per (batch size, temperature), with ratios to AR and to the best SD there."""
    lines = []
    for batch, t in sorted({(r.batch, r.temperature) for r in rows}):
        here = [r for r in rows if r.batch == batch and r.temperature == t]
        ar = next((r.tok_s for r in here if r.mode == "ar"), None)
        sd = max((r.tok_s for r in here if r.mode == "sd" and r.tok_s is not None), default=None)
        lines += [f"## Batch {batch}, {temp_key(t)}", "",
                  table(["config", "tok/s", "per request", "xAR", "xSD best", "tok/rnd", "accept", "p_hit"],
                        [[r.name + (" FAILED" if r.failure else ""), fmt(r.tok_s, ".1f"),
                          fmt(r.per_request_tok_s, ".1f"), fmt(ratio(r.tok_s, ar)), fmt(ratio(r.tok_s, sd)),
                          fmt(r.tokens_per_round), fmt(r.acceptance), fmt(r.p_hit)] for r in here]), ""]
        lines += [f"**{r.name} FAILED** at batch {batch}: SSD fell back to n-gram SD: {r.failure}." for r in here
                  if r.failure] + ([""] if any(r.failure for r in here) else [])
    return lines

