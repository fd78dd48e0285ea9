"""Adaptive K in simulation: the engine's chooser against every fixed K, on requests whose acceptance is known.

Each simulated request of ``--max-tokens`` tokens runs the real chooser (``AdaptiveK``, built as the engine builds
it for SD from the pair's calibration profile, or the documented defaults without one) round by round. A round
at K accepts each draft with probability a, in order, up to the first rejection (Thm 2's model), and costs K
draft steps and a verification of K + 1 rows at the profile's costs. The chooser observes what the engine would
show it (the drafts, the kept count, the pass times). A request's speedup is its tokens per second over AR's, one
row's verification per token.

Cases: each constant acceptance of ``--acceptances``, and two texts that change half way (a high acceptance then
a low one, and the reverse). Per case: the median speedup over ``--requests`` seeds of every fixed K and of the
adaptive default (and of each ``--variant``), the best fixed K (AR included), and the adaptive rows' ratio to it.
No machine noise enters: this measures the chooser's decisions, not the engine (``bench adapt`` does that).

    saguaro bench adapt_sim --target-weights int4 --draft-weights int4 --draft-vocab 65536
    saguaro bench adapt_sim --variant stay_gain=1.02,probe_interval=8    # another setting beside the default
"""
from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (WEIGHT_FORMATS, add_model_args, engine_options, environment, float_list, fmt, log,
                               median, ratio, settings, table, write_results)
from saguaro.adapt.build import k_schedule
from saguaro.adapt.costs import LiveCosts
from saguaro.adapt.schedule import AdaptiveK
from saguaro.adapt_settings import AdaptSettings
from saguaro.config import Config
from saguaro.engine.k_schedule import FixedK, KSchedule
from saguaro.engine.sequence import Sequence
from saguaro.sampling.params import SamplingParams

Acceptance = Callable[[int], float]  # tokens made so far -> the acceptance of the next round's drafts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench adapt_sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--target-weights", choices=WEIGHT_FORMATS, default="bf16", help="whose profile (default bf16)")
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default="bf16", help="whose profile (default bf16)")
    p.add_argument("--draft-vocab", type=int, default=None, help="the draft head's kept ids (as the profile's)")
    p.add_argument("--max-k", type=int, default=5, help="the largest K (default 5)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--requests", type=int, default=40, help="seeds per case (default 40)")
    p.add_argument("--acceptances", type=float_list, default=float_list("0.3,0.4,0.5,0.6,0.65,0.7,0.8,0.9"),
                   help="constant acceptances (default 0.3,0.4,0.5,0.6,0.65,0.7,0.8,0.9)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="AdaptSettings fields for one more adaptive row (repeatable)")
    p.add_argument("--out", default="results", help="directory for the JSON and Markdown files")
    args = p.parse_args(argv)
    if args.max_k < 1 or args.max_tokens < 1 or args.requests < 1:
        p.error("--max-k, --max-tokens and --requests must be >= 1")
    if any(not 0.0 <= a <= 1.0 for a in args.acceptances):
        p.error("--acceptances are probabilities in [0, 1]")
    try:
        args.variants = {v: AdaptSettings(**_fields(v)) for v in args.variant}
    except (TypeError, ValueError) as e:
        p.error(f"--variant: {e}")
    return args


def _fields(spec: str) -> dict[str, Any]:
    """``key=value,key=value`` -> AdaptSettings fields (numbers as numbers)."""
    out: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = float(value) if "." in value else int(value)
    return out


def chooser(args: argparse.Namespace, adapt: AdaptSettings) -> AdaptiveK:
    """The engine's adaptive SD schedule for this pair (its profile's priors and costs)."""
    cfg = Config(target=args.target, draft=args.draft, mode="sd", num_speculative_tokens=args.max_k,
                 target_weights=args.target_weights, draft_weights=args.draft_weights, draft_vocab=args.draft_vocab,
                 adapt=adapt, **engine_options(False))
    schedule = k_schedule(cfg)
    assert isinstance(schedule, AdaptiveK)
    return schedule


def simulate(schedule: KSchedule, costs: LiveCosts, acceptance: Acceptance, tokens: int, seed: int) -> float:
    """One request's speedup over AR: its rounds' tokens over their time, against one verification per token."""
    rng = random.Random(seed)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=tokens))
    made, seconds, draft = 0, 0.0, costs.draft_step(1)
    while made < tokens:
        k = schedule.choose([seq])[0]
        a, kept = acceptance(made), 0
        while kept < k and rng.random() < a:
            kept += 1
        verify = costs.verify(k + 1)
        schedule.observe(seq, k, kept)
        schedule.observe_verify(k + 1, verify)
        if k:
            schedule.observe_draft(1, k, k * draft)
        seconds += k * draft + verify
        made += kept + 1
    return made / seconds * costs.verify(1)


def cases(args: argparse.Namespace) -> list[tuple[str, Acceptance]]:
    half = args.max_tokens // 2
    out = [(f"a={a:g}", lambda made, a=a: a) for a in args.acceptances]
    out += [("0.8 then 0.4", lambda made: 0.8 if made < half else 0.4),
            ("0.4 then 0.8", lambda made: 0.4 if made < half else 0.8)]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    costs = chooser(args, AdaptSettings()).profile  # the profile's tables: the simulated passes cost exactly these
    rows: dict[str, Callable[[], KSchedule]] = {f"K={k}": (lambda k=k: FixedK(k)) for k in range(1, args.max_k + 1)}
    rows["adaptive"] = lambda: chooser(args, AdaptSettings())
    rows.update({f"adaptive {v}": (lambda s=s: chooser(args, s)) for v, s in args.variants.items()})
    results = []
    for name, acceptance in cases(args):
        speed = {"AR": 1.0}
        for row, make in rows.items():
            speed[row] = median(simulate(make(), costs, acceptance, args.max_tokens, seed)
                                for seed in range(args.requests))
        fixed = {r: s for r, s in speed.items() if not r.startswith("adaptive")}
        best = max(fixed, key=fixed.get)
        results.append({"case": name, "speedup": speed, "best_fixed": best,
                        "x_best": {r: ratio(s, fixed[best]) for r, s in speed.items() if r.startswith("adaptive")}})
        log(f"{name}: best {best} {fixed[best]:.3f}, adaptive {speed['adaptive']:.3f}")
    passes = {"verify_rows_1_to_6": [costs.verify(n) for n in range(1, 7)], "draft_step": costs.draft_step(1)}
    return {"rows": list(rows), "cases": results, "costs": passes}


def markdown(args: argparse.Namespace, result: dict[str, Any]) -> str:
    adaptive = [r for r in result["rows"] if r.startswith("adaptive")]
    headers = ["case", "AR", *result["rows"], "best fixed", *[f"{r} x best" for r in adaptive]]
    body = [[c["case"], *[fmt(c["speedup"][r], ".3f") for r in ["AR", *result["rows"]]], c["best_fixed"],
             *[fmt(c["x_best"][r], ".3f") for r in adaptive]] for c in result["cases"]]
    worst = {r: min(c["x_best"][r] for c in result["cases"]) for r in adaptive}
    c = result["costs"]
    return "\n".join([
        f"# Adaptive K in simulation: {args.target} with {args.draft} (target {args.target_weights}, draft "
        f"{args.draft_weights}), SD, K <= {args.max_k}",
        "",
        f"Speedup over AR (median of {args.requests} simulated requests of {args.max_tokens} tokens; acceptance a per "
        "draft, Thm 2's model), the chooser the engine builds from the pair's profile. Pass costs (the profile's): "
        f"a verification of 1..6 rows {', '.join(f'{v:.4g}' for v in c['verify_rows_1_to_6'])}, a draft step "
        f"{c['draft_step']:.4g} (seconds, or the defaults' units without a profile).",
        "",
        table(headers, body),
        "",
        "Worst ratio to the best fixed K: " + ", ".join(f"{r} {v:.3f}" for r, v in worst.items()) + ".",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = markdown(args, result)
    print(text)
    json_path, _ = write_results(Path(args.out), "bench_adapt_sim",
                                 {"env": environment(), "settings": settings(args), **result}, text)
    log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
