"""Saguaro figures (paper Sec. 4): PNGs under results/, their numbers in results/saguaro_plots.json.

    python -m benchmarks.plots_saguaro --draft-weights int8 --draft-vocab 65536   # every figure
                                                               # (a quiet machine; calibrate the same pair first)
    python -m benchmarks.plots_saguaro --prompts 1 --max-tokens 16 --batch-sizes 1,2 --c-values 1,0.5  # smoke
    python -m benchmarks.plots_saguaro --only fanout           # just the calibration figure (no decoding)

Figures (``--only`` names):
  fanout     miss rate vs fan-out on log-log axes with the fitted power law F^{-r} (Def. 11), after a primary
             and after a backup speculation (paper fig. 3); from the calibration profile (``saguaro calibrate``).
  geometric  uniform fan-out vs the Thm 12 / 13 shape with the same budget (and "auto", which also picks the
             budget) at temperatures 0, 0.5, 1: hit rate and tok/s (paper fig. 4).
  csweep     Saguaro sampling C sweep at temperature 1: acceptance, hit rate and tok/s (paper fig. 6 left).
  batch      batch sizes 1..16: SSD with jit fallback, SSD with the n-gram backup, SD and AR (paper fig. 7).
  predicted  predicted speedup over AR and over SD (Thm 2 / Cor. 17 from the calibrated quantities,
             saguaro.calibration.policy.predict_fixed) vs measured in paired, repeated runs
             (benchmarks/predicted.py: --repeats, --predict-groups, --predict-configs).

Prompts: HumanEval items from the start of the set (the calibration uses the end). Decode speed is the
median per-request decode tok/s (after a warm-up request); throughput is all generated tokens over wall
time. One run per point in the first four figures: timings on a shared machine are noisy. The predicted
figure pairs and repeats its runs instead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from saguaro.calibration.profile import Profile
from saguaro.config import WORKLOADS
from saguaro.models.draft_format import WEIGHT_FORMATS

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
FIGURES = ("fanout", "geometric", "csweep", "batch", "predicted")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plots_saguaro", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,0.5,1")
    p.add_argument("--c-values", default="1,0.75,0.5,0.25")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--uniform-f", type=int, default=2, help="geometric figure: uniform F per depth (budget F (K+1))")
    p.add_argument("--repeats", type=int, default=3, help="predicted figure: paired repeats per point")
    p.add_argument("--predict-groups", default="0:1;1:1",
                   help="predicted figure: 'T:batch;...' groups, each running AR, SD and every --predict-configs")
    p.add_argument("--predict-configs", default="auto@auto;last2@2;last2",
                   help="predicted figure: SSD fan-outs as in bench_ssd --fan-outs ('auto', 'lastN', counts; '@S' "
                        "or '@auto' tapers the tree)")
    p.add_argument("--only", default=",".join(FIGURES), help=f"comma separated subset of {', '.join(FIGURES)}")
    p.add_argument("--out", default="results")
    p.add_argument("--enforce-eager", action="store_true", help="the engine's eager reference (slow)")
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # deprecated: the fast path is default
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="the draft's weight format in SD and SSD (the profile for this format is used)")
    p.add_argument("--draft-vocab", type=int, default=None, help="the draft head keeps token ids below this")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed",
                   help="the calibration profile to predict from and to plan 'auto' with; 'code' matches these "
                        "HumanEval prompts (saguaro calibrate --workload code)")
    return p.parse_args(argv)


# -- running the engine --------------------------------------------------------------------------------
def _prompts(tokenizer, n: int) -> list[list[int]]:
    from saguaro import datasets
    return datasets.as_chat(tokenizer, [f"Complete this Python function:\n\n{p}" for p in datasets.humaneval(n)])


def run(args, mode: str, prompts: list[list[int]], temperature: float = 0.0, batch: int = 1, **opts) -> dict:
    """Decode ``prompts`` (repeated to fill ``batch``) in one engine; speeds and speculation metrics."""
    from saguaro import LLM, SamplingParams
    draft = None if mode == "ar" else args.draft
    common = dict(dtype=args.dtype, enforce_eager=args.enforce_eager, max_num_seqs=batch, kv_cache_tokens=16384,
                  max_model_len=4096)
    if mode != "ar":
        common.update(num_speculative_tokens=args.k, draft_weights=args.draft_weights, draft_vocab=args.draft_vocab,
                      calibration_workload=args.workload)
    llm = LLM(target=args.target, draft=draft, mode=mode, **common, **opts)
    try:
        llm.generate([prompts[0]], SamplingParams(max_tokens=4))  # warm-up: compiled graphs, worker caches
        work = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
        params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=i) for i in range(len(work))]
        start = time.perf_counter()
        outs = []
        for i in range(0, len(work), batch):
            outs += llm.generate(work[i:i + batch], params[i:i + batch])
        wall = time.perf_counter() - start
        metrics = llm.spec_metrics(outs)
        plan = getattr(llm.engine.decoder, "plan", None)
    finally:
        llm.close()
    row = {"mode": mode, "temperature": temperature, "batch": batch, **{k: v for k, v in opts.items()},
           "tok_s": statistics.median(o.timings.decode_tokens_per_s for o in outs),
           "throughput": sum(len(o.token_ids) for o in outs) / wall}
    if metrics is not None:
        row.update(acceptance=metrics.acceptance_rate, tokens_per_round=metrics.tokens_per_round,
                   p_hit=metrics.cache_hit_rate, p_hit_p=metrics.hit_rate_after_hit,
                   p_hit_b=metrics.hit_rate_after_miss)
    if plan is not None:
        row["plan_primary"] = plan.fan_out(temperature, "p", batch)
        row["plan_backup"] = plan.fan_out(temperature, "b", batch)
        row["plan_c"] = plan.c_for(temperature)
        row["plan_branch_steps"] = plan.steps_for(temperature)
        row["plan_deep"] = plan.deep_branches
    print(f"  {mode:3s} T={temperature} b={batch} {opts}: {row['tok_s']:.2f} tok/s, p_hit {row.get('p_hit')}, "
          f"acceptance {row.get('acceptance')}", flush=True)
    return row


def _uniform(budget: int, k: int) -> list[int]:
    base, extra = divmod(budget, k + 1)
    return [base + (1 if i < extra else 0) for i in range(k + 1)]


# -- figures -------------------------------------------------------------------------------------------
def fig_fanout(profile: Profile, out: Path, plt) -> dict:
    import numpy as np
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    data = {}
    for ax, source in zip(axes, ("primary", "backup")):
        for t, entry in sorted(profile.temperatures.items(), key=lambda kv: float(kv[0])):
            s = getattr(entry, source)
            miss = np.asarray(s.miss_uniform)
            F = np.arange(len(miss))
            keep = (F > 0) & (miss > 0)
            line = ax.loglog(F[keep], miss[keep], "o-", ms=3, label=f"T={t} measured")[0]
            if s.r:
                ax.loglog(F[F > 0], F[F > 0] ** -s.r, "--", color=line.get_color(),
                          label=f"T={t} Def. 11 fit F^-{s.r:.2f} (R²={s.r2:.2f})")
            if s.r_free:
                ax.loglog(F[F > 0], s.prefactor * F[F > 0] ** -s.r_free, ":", color=line.get_color(),
                          label=f"T={t} free fit {s.prefactor:.2f}·F^-{s.r_free:.2f} (R²={s.r2_free:.2f})")
            data[f"{source}@{t}"] = {k: getattr(s, k) for k in ("r", "r2", "r_free", "prefactor", "r2_free",
                                                                  "miss_uniform", "acceptance", "rounds")}
        ax.set_title(f"after a {source} speculation")
        ax.set_xlabel("fan-out F (same at every depth)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("cache miss rate 1 - p_hit(F)")
    fig.suptitle(f"{profile.target} / {profile.draft}: cache misses fall as a power law in the fan-out")
    fig.tight_layout()
    fig.savefig(out / "saguaro_fanout_powerlaw.png", dpi=120)
    plt.close(fig)
    return data


def fig_geometric(args, prompts, profile, out: Path, plt) -> list[dict]:
    """Per temperature: uniform F at every depth, the Thm 12 / 13 shape with the same budget, and "auto"
    (the policy's own budget)."""
    from saguaro.calibration.policy import entry_at, evaluate
    rows = []
    budget = args.uniform_f * (args.k + 1)
    for t in _floats(args.temperatures):
        shaped = evaluate(profile, entry_at(profile, t), args.k, 1, budget, "jit",
                          1 << 20).primary
        rows.append(dict(run(args, "ssd", prompts, t, fan_out=[args.uniform_f] * (args.k + 1)), shape="uniform"))
        rows.append(dict(run(args, "ssd", prompts, t, fan_out=shaped), shape="geometric/thm13, same budget"))
        rows.append(dict(run(args, "ssd", prompts, t, fan_out="auto"), shape="auto (own budget)"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for shape, marker in (("uniform", "s-"), ("geometric/thm13, same budget", "o-"), ("auto (own budget)", "^--")):
        sel = [r for r in rows if r["shape"] == shape]
        axes[0].plot([r["temperature"] for r in sel], [r["tok_s"] for r in sel], marker, label=shape)
        axes[1].plot([r["temperature"] for r in sel], [r["p_hit"] or 0 for r in sel], marker, label=shape)
    axes[0].set_ylabel("decode tok/s")
    axes[1].set_ylabel("cache hit rate")
    for ax in axes:
        ax.set_xlabel("temperature")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"uniform vs geometric (Thm 12 / 13) fan-out, budget {budget} branches per sequence")
    fig.tight_layout()
    fig.savefig(out / "saguaro_geometric_vs_uniform.png", dpi=120)
    plt.close(fig)
    return rows


def fig_csweep(args, prompts, out: Path, plt) -> list[dict]:
    rows = [dict(run(args, "ssd", prompts, 1.0, fan_out="auto", saguaro_c=c), c=c) for c in _floats(args.c_values)]
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [r["c"] for r in rows]
    ax.plot(cs, [r["acceptance"] for r in rows], "o-", label="acceptance")
    ax.plot(cs, [r["p_hit"] or 0 for r in rows], "s-", label="cache hit rate")
    ax.set_xlabel("Saguaro C (Def. 14)")
    ax.set_ylabel("rate")
    ax2 = ax.twinx()
    ax2.plot(cs, [r["tok_s"] for r in rows], "^--", color="gray", label="tok/s")
    ax2.set_ylabel("decode tok/s")
    ax.legend(loc="lower left")
    ax2.legend(loc="lower right")
    ax.grid(alpha=0.3)
    ax.set_title("Saguaro sampling: acceptance vs cache hits (temperature 1)")
    fig.tight_layout()
    fig.savefig(out / "saguaro_c_sweep.png", dpi=120)
    plt.close(fig)
    return rows


def fig_batch(args, prompts, out: Path, plt) -> list[dict]:
    rows = []
    for b in [int(x) for x in _floats(args.batch_sizes)]:
        rows.append(dict(run(args, "ar", prompts, batch=b), label="AR"))
        rows.append(dict(run(args, "sd", prompts, batch=b), label="SD"))
        rows.append(dict(run(args, "ssd", prompts, batch=b, fan_out="auto", miss_strategy="jit"), label="SSD jit"))
        rows.append(dict(run(args, "ssd", prompts, batch=b, fan_out="auto", miss_strategy="ngram"), label="SSD n-gram"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in ("AR", "SD", "SSD jit", "SSD n-gram"):
        sel = [r for r in rows if r["label"] == label]
        axes[0].plot([r["batch"] for r in sel], [r["tok_s"] for r in sel], "o-", label=label)
        axes[1].plot([r["batch"] for r in sel], [r["throughput"] for r in sel], "o-", label=label)
    axes[0].set_ylabel("per-request decode tok/s")
    axes[1].set_ylabel("throughput, tok/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("fallback vs batch size (Thm 18): just-in-time draft vs fast n-gram backup")
    fig.tight_layout()
    fig.savefig(out / "saguaro_batch_fallback.png", dpi=120)
    plt.close(fig)
    return rows


def fig_predicted(args, prompts, profile: Profile, out: Path, plt) -> dict:
    """Paired, repeated runs (benchmarks/predicted.py): AR, SD and SSD back to back per repeat."""
    from benchmarks import predicted
    rows = predicted.measure(run, args, prompts)
    pts = predicted.points(args, rows, profile)
    predicted.figure(pts, out, plt)
    print(predicted.table(pts))
    return {"points": pts, "runs": rows}


def main(argv: list[str] | None = None) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from saguaro.calibration.store import resolve_profile
    from saguaro.loading import load_tokenizer
    args = parse_args(argv)
    only = set(args.only.split(","))
    unknown = only - set(FIGURES)
    if unknown:
        print(f"unknown figure(s) {sorted(unknown)}; known: {', '.join(FIGURES)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from saguaro.models.draft_format import DraftFormat
    profile = resolve_profile(args.target, args.draft, args.dtype, args.k, enforce_eager=args.enforce_eager,
                              draft_format=DraftFormat(args.draft_weights, args.draft_vocab).tag,
                              workload=args.workload)
    if profile.default:
        print("note: no calibration profile for this pair; figures use the documented defaults "
              "(run `saguaro calibrate` first)", file=sys.stderr)
    prompts = _prompts(load_tokenizer(args.target), args.prompts) if only - {"fanout"} else []
    from benchmarks.common import command_line
    results: dict = {"command": command_line(), "settings": vars(args), "profile_default": profile.default}
    if "fanout" in only:
        results["fanout"] = fig_fanout(profile, out, plt)
    if "geometric" in only:
        results["geometric"] = fig_geometric(args, prompts, profile, out, plt)
    if "csweep" in only:
        results["csweep"] = fig_csweep(args, prompts, out, plt)
    if "batch" in only:
        results["batch"] = fig_batch(args, prompts, out, plt)
    if "predicted" in only:
        results["predicted"] = fig_predicted(args, prompts, profile, out, plt)
    path = out / "saguaro_plots.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {path} and PNGs under {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
