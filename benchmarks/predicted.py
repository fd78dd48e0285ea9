"""Predicted vs measured speedup, measured in pairs (the ``predicted`` figure of plots_saguaro).

On the shared 2-core VM a single run moves by about 30%: the host drifts between a fast and a slow spell
for minutes at a time. A prediction cannot be checked to 10% against one run per point, and not against
an AR baseline timed ten minutes earlier either. So the measurement is paired and repeated:

* in every repeat and for every (temperature, batch) group, AR, SD and each SSD configuration run back to
  back on the same prompts, each in a fresh engine after a warm-up request;
* a point's measured speedup is the median over repeats of that repeat's ratio (SSD/AR, SSD/SD), and
  the spread of the per-repeat ratios is drawn as its error bar.

The prediction is ``saguaro.calibration.policy.predict_fixed`` for the plan the engine actually ran (its
fan-out lists after a primary and after a backup speculation, C, the tapered tree's S and deep branches),
and ``sd_speedup_vs_ar`` for SD: both from the calibration profile alone.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Callable

from benchmarks.common import parse_fan_out
from saguaro.calibration.profile import Profile

Run = Callable[..., dict]  # plots_saguaro.run(args, mode, prompts, temperature, batch, **options) -> row


def parse_groups(text: str) -> list[tuple[float, int]]:
    """'T:b;T:b' -> [(temperature, batch), ...] ('0:1;1:1' is greedy and T=1 at batch 1)."""
    groups = []
    for item in text.replace(" ", "").split(";"):
        if item:
            t, _, b = item.partition(":")
            groups.append((float(t), int(b or 1)))
    return groups


def label(spec: str) -> str:
    return f"SSD {spec}"


def measure(run: Run, args, prompts: list[list[int]]) -> list[dict]:
    """Every repeat x group: AR, SD, then every SSD configuration of ``args.predict_configs``."""
    specs = [s.strip() for s in args.predict_configs.split(";") if s.strip()]
    rows = []
    for repeat in range(args.repeats):
        for t, b in parse_groups(args.predict_groups):
            print(f"repeat {repeat + 1}/{args.repeats}, T={t:g}, batch {b}", flush=True)
            ar = run(args, "ar", prompts, t, b)
            sd = run(args, "sd", prompts, t, b)
            rows.append(dict(repeat=repeat, temperature=t, batch=b, config="SD", run=sd, ar=ar, sd=sd))
            for spec in specs:
                fan_out, steps = parse_fan_out(spec, args.k)
                options = dict(fan_out=fan_out) | ({"branch_steps": steps} if steps is not None else {})
                ssd = run(args, "ssd", prompts, t, b, **options)
                rows.append(dict(repeat=repeat, temperature=t, batch=b, config=label(spec), run=ssd, ar=ar, sd=sd))
    return rows


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def points(args, rows: list[dict], profile: Profile) -> list[dict]:
    """One point per (temperature, batch, configuration): medians of the paired ratios and the prediction."""
    from saguaro.calibration.policy import predict_fixed, sd_speedup_vs_ar
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        grouped[(r["temperature"], r["batch"], r["config"])].append(r)
    out = []
    for (t, b, config), reps in grouped.items():
        vs_ar = _spread([r["run"]["tok_s"] / r["ar"]["tok_s"] for r in reps])
        vs_sd = _spread([r["run"]["tok_s"] / r["sd"]["tok_s"] for r in reps])
        sd_pred = sd_speedup_vs_ar(profile, t, args.k) if b == 1 else None
        point = dict(temperature=t, batch=b, config=config, measured=vs_ar, measured_vs_sd=vs_sd,
                     tok_s=statistics.median(r["run"]["tok_s"] for r in reps))
        if config == "SD":
            point.update(predicted=sd_pred, predicted_vs_sd=1.0 if sd_pred else None)
        else:
            plan = reps[-1]["run"]  # the plan is the profile's, the same in every repeat
            kind = "jit" if plan.get("fallback", "jit") == "jit" else "ngram"
            pred = predict_fixed(profile, t, args.k, b, plan["plan_primary"], plan["plan_backup"], kind,
                                 plan.get("plan_c", 1.0), plan.get("plan_branch_steps"), plan.get("plan_deep", 1))
            hits = [r["run"]["p_hit"] for r in reps if r["run"].get("p_hit") is not None]
            point.update(predicted=pred.speedup_vs_ar,
                         predicted_vs_sd=pred.speedup_vs_ar / sd_pred if sd_pred else None,
                         predicted_p_hit=pred.p_hit, measured_p_hit=statistics.median(hits) if hits else None,
                         plan={k: v for k, v in plan.items() if k.startswith("plan_")})
        if point["predicted"]:
            point["error"] = point["predicted"] / vs_ar["median"] - 1
        out.append(point)
    return out


def table(pts: list[dict]) -> str:
    """Markdown: predicted vs measured (median of paired ratios, with the range over repeats)."""
    lines = ["| T | batch | config | plan | predicted xAR | measured xAR (range) | error | predicted xSD | "
             "measured xSD (range) | predicted p_hit | measured p_hit |", "|" + "---|" * 11]

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    for p in pts:
        m, s, plan = p["measured"], p["measured_vs_sd"], p.get("plan", {})
        shape = (f"{plan.get('plan_primary')}" + (f"@{plan['plan_branch_steps']}" if plan.get("plan_branch_steps")
                                                   else "")) if plan else "-"
        lines.append(f"| {p['temperature']:g} | {p['batch']} | {p['config']} | {shape} | {fmt(p['predicted'])} | "
                     f"{m['median']:.2f} ({m['min']:.2f}-{m['max']:.2f}) | {fmt(p.get('error'), '+.1%')} | "
                     f"{fmt(p['predicted_vs_sd'])} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | "
                     f"{fmt(p.get('predicted_p_hit'))} | {fmt(p.get('measured_p_hit'))} |")
    errors = [abs(p["error"]) for p in pts if p.get("error") is not None]
    if errors:
        lines.append(f"\nMedian |error| {statistics.median(errors):.1%}; within 10%: "
                     f"{sum(e <= 0.10 for e in errors)} of {len(errors)} points.")
    return "\n".join(lines)


def figure(pts: list[dict], out: Path, plt) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for key, ax, title in (("measured", axes[0], "speedup over AR"), ("measured_vs_sd", axes[1], "speedup over SD")):
        pred_key = "predicted" if key == "measured" else "predicted_vs_sd"
        sel = [p for p in pts if p.get(pred_key)]
        for p in sel:
            m = p[key]
            ax.errorbar([p[pred_key]], [m["median"]], yerr=[[m["median"] - m["min"]], [m["max"] - m["median"]]],
                        fmt="s" if p["config"] == "SD" else "o", capsize=3,
                        label=f"T={p['temperature']:g} b={p['batch']} {p['config']}")
        top = max([max(p[pred_key], p[key]["max"]) for p in sel] + [1.0]) * 1.1
        ax.plot([0, top], [0, top], "k--", lw=1)
        ax.plot([0, top], [0, 1.1 * top], "k:", lw=0.8)
        ax.plot([0, top], [0, 0.9 * top], "k:", lw=0.8)
        ax.set_xlabel(f"predicted {title} (Thm 2 / Cor. 17)")
        ax.set_ylabel(f"measured {title} (median of paired runs)")
    hits = [p for p in pts if p.get("predicted_p_hit") is not None and p.get("measured_p_hit") is not None]
    axes[2].scatter([p["predicted_p_hit"] for p in hits], [p["measured_p_hit"] for p in hits])
    axes[2].plot([0, 1], [0, 1], "k--", lw=1)
    axes[2].set_xlabel("predicted cache hit rate")
    axes[2].set_ylabel("measured cache hit rate")
    axes[0].legend(fontsize=6)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("theory from calibrated quantities vs paired measurement (dotted: +-10%)")
    fig.tight_layout()
    fig.savefig(out / "saguaro_predicted_vs_measured.png", dpi=120)
    plt.close(fig)
