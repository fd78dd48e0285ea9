"""``saguaro calibrate``: measure a target/draft pair on held-out prompts and store its profile.

What is measured (schema in ``saguaro.calibration.profile``):

1. **Timings** on one core: a target forward over n rows (n = K+1 is a verification) and a draft forward
   over n rows (a branch step of n rows, or a glue), for n on a grid, on a context of the prompts' mean
   length; one n-gram proposal. Min over repeats. T_p = K draft steps / verification, T_b = n-gram /
   verification (Thm 2's symbols).
2. **Acceptance and hit curves** per temperature, from SSD runs through the real engine with the
   speculator in this process (``InProcessLink``) and a ``RankRecorder``: one run where every speculation is
   drafted by the primary (jit miss strategy, empty cache) and one where every speculation comes from the n-gram
   backup. For each verified round with outcome (k, t*), the rank of t* among the draft's logits at depth
   k (the drafted token excluded when k < n) gives p_hit^k(F) = P(rank < F) for every F at once (Thm 13's
   curves), after a primary and after a backup speculation separately; the uniform-fan-out miss rate is
   fitted with the power law 1 - p_hit(F) = F^{-r} (Def. 11, ``theory.fit_power_law``).
3. **Saguaro C sweep** (optional, temperatures > 0): the primary run again with sigma_{F,C} sampling, F from
   the plan chosen at C = 1, giving a_p(C) and the hit curves under C (the trade-off of Thm 15).

Prompts are held out from the benchmarks, which take their prompts from the start of each set: the last
HumanEval items and the last MT-Bench questions.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from saguaro import datasets
from saguaro.calibration.contention import measure as measure_contention
from saguaro.calibration.miss_rounds import follow_ups
from saguaro.calibration.policy import make_plan
from saguaro.calibration.profile import (F_MAX, POWER_LAW_R2, ROW_GRID, Profile, RowTimes, Source, StepOverhead,
                                         TemperatureEntry, Timing, dtype_name)
from saguaro.calibration.timer import RowTimer, runner_factory
from saguaro.config import Config, check_workload
from saguaro.loading.place import place
from saguaro.engine.llm_engine import LLMEngine
from saguaro.engine.metrics import summarize
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.models.draft_format import DraftFormat
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.params import SamplingParams
from saguaro.sampling.ranked import rank_positions
from saguaro.sampling.sampler import sample
from saguaro.sd.ngram_proposer import NgramProposer
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.ranks import RankRecord, RankRecorder
from saguaro.ssd_settings import DraftedBy, MissStrategy, SSDSettings
from saguaro.ssd.ssd_decoder import SSDDecoder
from saguaro.ssd.host import SpeculatorOptions
from saguaro.ssd.in_process import InProcessLink
from saguaro.theory import fit_power_law


def calibration_prompts(tokenizer, n: int, workload: str = "mixed") -> list[list[int]]:
    """``n`` chat prompts, held out from the benchmarks (which start at the front of each set): the last
    HumanEval items ("code"), the last MT-Bench questions ("chat"), or both alternating ("mixed")."""
    check_workload(workload)
    n_code = {"mixed": (n + 1) // 2, "code": n, "chat": 0}[workload]
    code = [f"Complete this Python function:\n\n{p}" for p in datasets.humaneval()[::-1][:n_code]]
    chat = datasets.mtbench()[::-1][:n - n_code]
    texts = [t for pair in zip(code, chat) for t in pair] + code[len(chat):] + chat[len(code):]
    return datasets.as_chat(tokenizer, texts[:n])


# -- timings -------------------------------------------------------------------------------------------
def monotone(times: RowTimes) -> RowTimes:
    """More rows never cost less: replace each time by the least time measured at >= as many rows.

    On a shared machine a load spike inflates single measurements; the lower envelope discards them.
    """
    out, best = {}, math.inf
    for n in sorted(times, key=int, reverse=True):
        best = min(best, times[n])
        out[n] = best
    return {n: out[n] for n in sorted(out, key=int)}


def time_rows(runners: dict, rows: list[int], context: int, repeats: int = 5) -> dict[str, RowTimes]:
    """Per model (``runners``: name -> ``make_runner(num_blocks, block_size)``), seconds for one forward over
    n new rows after ``context`` tokens: min over ``repeats`` interleaved rounds (every model and row count
    once per round, so slow spells hit all of them)."""
    timers = {name: RowTimer(make, context, max(rows)) for name, make in runners.items()}
    raw = {name: {str(n): math.inf for n in rows} for name in runners}
    for _ in range(repeats):
        for n in rows:
            for name, timer in timers.items():
                raw[name][str(n)] = min(raw[name][str(n)], timer.once(n))
    return raw


def time_ngram(prompt: list[int], k: int, repeats: int = 20) -> float:
    seq = Sequence(prompt, SamplingParams())
    proposer = NgramProposer()
    proposer.propose([seq], [k])  # builds the index
    best = math.inf
    for i in range(repeats):
        seq.output_ids.append(prompt[i % len(prompt)])
        start = time.perf_counter()
        proposer.propose([seq], [k])
        best = min(best, time.perf_counter() - start)
    return best


CONTENTION_WIDTHS = (1, 4, 8, 16)  # draft pass widths probed beside a verification
OVERHEAD_WIDTHS = (1, 4, 8, 16)  # branch-step widths whose per-step sampling work is timed


def time_step_overhead(vocab: int, widths=OVERHEAD_WIDTHS, repeats: int = 5) -> StepOverhead:
    """Seconds a build step spends on its logits besides the forward, per width: the draft's ranked ids and
    the argmax ("greedy"), or the processed distributions and a seeded draw ("sampled"), as the speculator
    does them (``Speculator._decode_branches``)."""
    out: dict[str, RowTimes] = {"greedy": {}, "sampled": {}}
    for n in widths:
        logits = torch.randn(n, vocab)
        seqs = [Sequence([1], SamplingParams(temperature=1.0, seed=i)) for i in range(n)]

        def greedy() -> None:
            rank_positions(logits, 8)
            logits.argmax(dim=-1)

        def sampled() -> None:
            rank_positions(logits, 8)
            sample(processed_probs(logits, seqs), [s.generator for s in seqs], torch.zeros(n, dtype=torch.bool))

        for name, work in (("greedy", greedy), ("sampled", sampled)):
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                work()
                best = min(best, time.perf_counter() - start)
            out[name][str(n)] = best
    return StepOverhead(**out)


def measure_timing(target, draft, k: int, context: int, max_rows: int = 64, repeats: int = 5,
                   prompt: list[int] | None = None, enforce_eager: bool = True,
                   draft_format: DraftFormat = DraftFormat(), contention: bool = False,
                   target_weights: str = "bf16") -> Timing:
    """Timings of the target (as the engine runs it, its weights packed as ``target_weights``) and of the draft in
    ``draft_format``; with ``contention``, also the target's verification beside a busy draft on core 1
    (``contention.measure``)."""
    rows = sorted(set([n for n in ROW_GRID if n <= max_rows] + [k + 1]))
    draft = place(draft, "cpu", draft_format.dtype(model_dtype(draft)))
    runners = {"target": runner_factory(target, enforce_eager, target_weights=target_weights),
               "draft": runner_factory(draft, enforce_eager, draft_format)}
    raw = time_rows(runners, rows, context, repeats)
    target_rows, draft_rows = monotone(raw["target"]), monotone(raw["draft"])
    ngram = time_ngram(prompt or list(range(context)), k)
    verify, step = target_rows[str(k + 1)], draft_rows["1"]
    timing = Timing(target_rows=target_rows, draft_rows=draft_rows, ngram_s=ngram, verify_s=verify, draft_step_s=step,
                    T_p=k * step / verify, T_b=ngram / verify, context=context, repeats=repeats, raw=raw,
                    step_overhead=time_step_overhead(draft.config.vocab_size))
    if contention:
        timing.contention = measure_contention(target, draft, k + 1, list(CONTENTION_WIDTHS), dtype=model_dtype(target),
                                               enforce_eager=enforce_eager, draft_format=draft_format, context=context,
                                               target_weights=target_weights)
    return timing


def model_dtype(loaded) -> torch.dtype:
    return next(loaded.model.parameters()).dtype


# -- ranks ---------------------------------------------------------------------------------------------
def run_ranked(target, draft, prompts: list[list[int]], params: list[SamplingParams], k: int, plan: SpecPlan,
               max_num_seqs: int = 8, block_size: int = 16, build_branches: bool = False, enforce_eager: bool = True,
               draft_format: DraftFormat = DraftFormat(), target_weights: str = "bf16"
               ) -> tuple[list[RankRecord], dict]:
    """Run SSD over the prompts with the speculator in this process, recording bonus-token ranks.

    ``build_branches=False`` skips decoding the cache (ranks need only the glue's logits)."""
    max_len = max(len(p) for p in prompts) + max(p.max_tokens for p in params) + 2 * (k + 1)
    kv_tokens = (max_len + block_size) * max_num_seqs
    runner = ModelRunner(target.model, math.ceil(kv_tokens / block_size), block_size, enforce_eager=enforce_eager,
                         weights=target_weights)
    # the engine's SSD settings, with the speculator in this process: on the CPU, unpinned, one thread
    cfg = Config(target=target.name, draft=draft.name, mode="ssd", num_speculative_tokens=k,
                 dtype=dtype_name(model_dtype(draft)), draft_cores=None, kv_cache_tokens=kv_tokens,
                 block_size=block_size, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                 draft_weights=draft_format.weights, draft_vocab=draft_format.vocab, worker_timeout_s=600.0,
                 target_weights=target_weights)
    opts = SpeculatorOptions.from_config(cfg, plan)
    recorder = RankRecorder(build_branches=build_branches)
    decoder = SSDDecoder(runner, InProcessLink(draft, opts, recorder), plan, max_len)
    engine = LLMEngine(runner, target.tokenizer, decoder, max_len, max_num_seqs, 1 << 14)
    try:
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.close()
    metrics = summarize([s.spec for s in seqs], True)
    return recorder.records, {"acceptance": metrics.acceptance_rate, "tokens_per_round": metrics.tokens_per_round,
                              "acceptance_by_position": metrics.acceptance_by_position, "rounds": metrics.rounds,
                              "sequences": {s.seq_id: list(s.tokens) for s in seqs}}


def _r2(F: np.ndarray, miss: np.ndarray, r: float) -> float:
    keep = (F > 0) & (miss > 0) & (miss <= 1)
    lf, lm = np.log(F[keep]), np.log(miss[keep])
    if lm.size < 2:
        return 0.0
    ss_tot = float(np.sum((lm - lm.mean()) ** 2))
    ss_res = float(np.sum((lm + r * lf) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res < 1e-12 else 0.0)


def free_power_law(F: np.ndarray, miss: np.ndarray) -> dict:
    """Ordinary log-log fit miss = A F^{-r} (a prefactor A, unlike Def. 11): its exponent, A and R^2.

    Reported next to Def. 11's r because measured curves sit below 1 at F = 1. A prefactor shared by every
    depth leaves Thm 12's geometric shape unchanged (it cancels in the Lagrange conditions)."""
    keep = (F > 0) & (miss > 0) & (miss <= 1)
    if keep.sum() < 2:
        return {"r_free": None, "prefactor": None, "r2_free": 0.0}
    lf, lm = np.log(F[keep]), np.log(miss[keep])
    slope, intercept = np.polyfit(lf, lm, 1)
    ss_tot = float(np.sum((lm - lm.mean()) ** 2))
    r2 = 1.0 - float(np.sum((lm - slope * lf - intercept) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return {"r_free": float(-slope), "prefactor": float(np.exp(intercept)), "r2_free": r2}


def summarize_source(records: list[RankRecord], k: int, engine_metrics: dict) -> Source:
    """A profile's ``Source`` from one run's rank records (see ``saguaro.calibration.profile``)."""
    ranked = [r for r in records if r.rank >= 0]
    depth = np.array([r.accepted if r.accepted < r.drafted else k for r in ranked], dtype=int)
    ranks = np.array([r.rank for r in ranked], dtype=int)
    grid = np.arange(F_MAX + 1)

    def curve(sel: np.ndarray) -> list[float]:
        return (ranks[sel][:, None] < grid[None, :]).mean(axis=0).tolist() if sel.any() else None

    pooled = curve(np.ones(len(ranks), dtype=bool)) if len(ranks) else [0.0] + [1.0] * F_MAX
    curves = [curve(depth == d) or pooled for d in range(k + 1)]
    miss = 1.0 - np.asarray(pooled)
    try:
        r = fit_power_law(grid[1:], miss[1:])
        r2 = _r2(grid[1:].astype(float), miss[1:], r)
    except ValueError:  # no miss at any F >= 1
        r, r2 = None, 0.0
    free = free_power_law(grid[1:].astype(float), miss[1:])
    full = [rec for rec in records if rec.drafted == k]
    pmf = np.bincount([rec.accepted for rec in full], minlength=k + 1)[:k + 1] / max(len(full), 1)
    all_depths = np.bincount([rec.accepted if rec.accepted < rec.drafted else k for rec in records],
                             minlength=k + 1)[:k + 1] / max(len(records), 1)
    drafted = sum(rec.drafted for rec in records)
    accepted = sum(rec.accepted for rec in records)
    rejections = sum(rec.accepted < rec.drafted for rec in records)
    return Source(rounds=len(records), ranked_rounds=len(ranked),
                  # a: P(a drafted token is accepted | every earlier one was) -- the capped-geometric MLE
                  acceptance=accepted / (accepted + rejections) if accepted + rejections else 0.0,
                  accepted_per_drafted=accepted / drafted if drafted else 0.0,
                  acceptance_by_position=engine_metrics.get("acceptance_by_position", []),
                  depth_pmf=all_depths.tolist(),
                  tokens_per_round=(accepted + len(records)) / max(len(records), 1),
                  outcome_pmf=pmf.tolist(), hit_curves=curves, miss_uniform=miss.tolist(),
                  r=r, r2=r2, power_law=bool(r is not None and r > 0 and r2 >= POWER_LAW_R2), **free)


def _source_run(target, draft, prompts, temperature, k, source: str, max_tokens, batch, plan=None,
                enforce_eager: bool = True, draft_format: DraftFormat = DraftFormat(),
                target_weights: str = "bf16") -> Source:
    plan = plan or SpecPlan.fixed([0] * (k + 1), 1.0, MissStrategy.JIT if source == "primary" else MissStrategy.NGRAM)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 + i)
              for i in range(len(prompts))]
    records, metrics = run_ranked(target, draft, prompts, params, k, plan, batch, enforce_eager=enforce_eager,
                                  draft_format=draft_format, target_weights=target_weights)
    drafted_by = DraftedBy.PRIMARY if source == "primary" else DraftedBy.BACKUP
    summary = summarize_source([r for r in records if r.drafted_by == drafted_by], k, metrics)
    if source == "primary":  # what each miss strategy would deliver after each round (miss_rounds)
        summary.follow_ups = follow_ups(records, metrics["sequences"], k)
    return summary


def kernel_tier(target, dtype, enforce_eager: bool) -> str:
    """The CPU kernel tier the fast path runs (and so is timed on) here; "" off the CPU kernels."""
    weight = next(target.model.parameters(), None)
    if enforce_eager or dtype_name(dtype) != "bfloat16" or (weight is not None and weight.device.type != "cpu"):
        return ""
    from saguaro.backends.cpu_kernels import build
    return build.running_tier() or ""


def calibrate(target, draft, *, dtype="bfloat16", k: int = 4, temperatures=(0.0, 1.0), c_values=(),
              prompts: int = 8, max_tokens: int = 64, batch: int = 8, max_rows: int = 64,
              prompt_ids: list[list[int]] | None = None, log: Callable[[str], None] = print,
              enforce_eager: bool = True, draft_format: DraftFormat = DraftFormat(), contention: bool = False,
              workload: str = "mixed", target_weights: str = "bf16") -> Profile:
    """Measure the pair (``LoadedModel``s, already on their device and dtype) and return its profile.

    ``enforce_eager`` False: run both models through the bf16 fast path (as ``Config``, the default), so the timings
    match an engine started without ``enforce_eager``. ``draft_format``: the draft's weights and head, as the
    engine's ``draft_weights`` / ``draft_vocab``; the profile is keyed by it. ``contention``: probe how much
    the draft on core 1 slows verification on core 0 (the calling process is pinned to core 0 meanwhile).
    ``target_weights``: the target's packed weights (int8, int4: the CPU kernels); the profile is keyed by them."""
    start = time.perf_counter()
    prompt_ids = prompt_ids or calibration_prompts(target.tokenizer, prompts, workload)
    context = int(np.mean([len(p) for p in prompt_ids]))
    log(f"calibrating {target.name} [{target_weights}] / {draft.name} [{draft_format.tag or 'bf16'}] "
        f"({dtype_name(dtype)}), K={k}, "
        f"{len(prompt_ids)} prompts, "
        f"{max_tokens} tokens each, temperatures {list(temperatures)}")
    timing = measure_timing(target, draft, k, context, max_rows, prompt=prompt_ids[0], enforce_eager=enforce_eager,
                            draft_format=draft_format, contention=contention, target_weights=target_weights)
    log(f"  timing: verify(K+1) {timing.verify_s * 1e3:.1f} ms, draft step {timing.draft_step_s * 1e3:.1f} ms, "
        f"T_p {timing.T_p:.2f}, T_b {timing.T_b:.4f}")
    profile = Profile(target=target.name, draft=draft.name, draft_format=draft_format.tag, workload=workload,
                      target_weights=target_weights,
                      dtype=dtype_name(dtype), enforce_eager=bool(enforce_eager), k=k,
                      kernels=kernel_tier(target, dtype, enforce_eager),
                      created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                      settings={"prompts": len(prompt_ids), "max_tokens": max_tokens, "batch": batch,
                                "temperatures": list(temperatures), "c_values": list(c_values),
                                "threads": torch.get_num_threads(), "torch": torch.__version__},
                      timing=timing, temperatures={})
    for t in temperatures:
        sources = {}
        for source in ("primary", "backup"):
            s = sources[source] = _source_run(target, draft, prompt_ids, t, k, source, max_tokens, batch,
                                              enforce_eager=enforce_eager,
                                              draft_format=draft_format, target_weights=target_weights)
            log(f"  T={t} {source}: acceptance {s.acceptance:.3f}, {s.rounds} rounds, "
                f"p_hit(F=1) {1 - s.miss_uniform[1]:.2f}, r {s.r if s.r is None else round(s.r, 3)} "
                f"(R^2 {s.r2:.2f})")
        profile.temperatures[str(float(t))] = TemperatureEntry(**sources, temperature=float(t))
    vocab = target.config.vocab_size
    for t in [t for t in temperatures if t > 0]:
        key = str(float(t))
        for c in [c for c in c_values if c < 1.0]:
            one = replace(profile, temperatures={key: profile.temperatures[key]})
            reweight = make_plan(one, k, SSDSettings(fan_out="auto"), 1, vocab).plan.primary[0][0]
            s = _source_run(target, draft, prompt_ids, t, k, "primary", max_tokens, batch,
                            SpecPlan.fixed(reweight, c, MissStrategy.JIT), enforce_eager=enforce_eager,
                            draft_format=draft_format, target_weights=target_weights)
            s.c, s.fan_out = float(c), reweight
            profile.temperatures[key].c_sweep.append(s)
            log(f"  T={t} C={c}: acceptance {s.acceptance:.3f}, p_hit(F=1) {1 - s.miss_uniform[1]:.2f} "
                f"(sigma_F,C with F={reweight})")
    profile.settings["seconds"] = round(time.perf_counter() - start, 1)
    return profile
