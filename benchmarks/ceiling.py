"""The bus ceiling of each SSD configuration in a benchmark run (saguaro.theory.bandwidth).

Per SSD configuration of lookahead K, from quantities measured in the same run:
  - E_SD(K) and T_v: SD's tokens per round and its verification time at the same K on one core
    (the other core idle);
  - W_t, W_d: the bytes one target verification and one draft pass stream (the contention probe);
  - B_1, B_2: one core streaming alone, both cores together (the bus probe).
The ceiling is E_SD(K) / max(T_v, (W_t + (K+1) W_d) / B_2): no SSD run at this K can be faster on
this machine, whatever its hit rate. The bus cap is the ceiling over SD at the same K if every pass
streamed at B_1 (ideal kernels): it shows how much room the bus itself leaves.
"""
from __future__ import annotations

from typing import Any

from benchmarks.common import fmt, ratio, table
from saguaro.theory.bandwidth import bus_cap, ssd_round_floor, ssd_tok_s_ceiling


def ceiling_rows(plan_: dict[str, Any], summaries: dict[str, Any], contention: dict[str, Any],
                 bus: dict[str, Any], sd_best: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per (SSD configuration, temperature, dataset or all) whose K has an SD run: the ceiling next to
    the measurement.

    ``sd_best``: per temperature key and group, the fastest SD's tok/s on one core in this run."""
    wt, wd = contention["target_pass_bytes"], contention["draft_pass_bytes"]
    b1, b2 = bus["bus_alone"], bus["bus_total"]
    out = []
    for name in plan_["ssd"]:
        k = plan_["ssd_k"][name]
        sd = summaries.get(f"SD K={k} (1 core)")
        if sd is None:
            continue
        for tk, by_group in summaries[name].items():
            for group, s in by_group.items():
                e, verify_ms = sd[tk][group].get("tokens_per_round"), sd[tk][group].get("verify_ms_median")
                if not e or not verify_ms:
                    continue
                floor = ssd_round_floor(verify_ms / 1e3, wt, wd, k + 1, b2)
                ceiling = ssd_tok_s_ceiling(e, verify_ms / 1e3, wt, wd, k, b2)
                best = sd_best.get(tk, {}).get(group)
                out.append({"config": name, "temperature": tk, "group": group, "k": k, "sd_tokens_per_round": e,
                            "verify_ms": verify_ms, "floor_ms": 1e3 * floor,
                            "bus_limited": floor > verify_ms / 1e3 + 1e-12, "ceiling_tok_s": ceiling,
                            "ceiling_x_sd": ratio(ceiling, best), "measured_tok_s": s["tok_s_median"],
                            "measured_x_sd": ratio(s["tok_s_median"], best),
                            "measured_of_ceiling": ratio(s["tok_s_median"], ceiling),
                            "bus_cap": bus_cap(wt, wd, k, b1, b2)})
    return out


def ceiling_section(rows: list[dict[str, Any]], contention: dict[str, Any], bus: dict[str, Any]) -> list[str]:
    wt, wd = contention["target_pass_bytes"], contention["draft_pass_bytes"]
    achieved = [b.get("bus_bytes_per_s") for b in contention.get("busy", []) if b.get("bus_bytes_per_s")]
    lines = ["", "## The bus ceiling (saguaro.theory.bandwidth)", "",
             f"Bytes per pass: target verification W_t = {wt / 1e9:.3f} GB, draft pass W_d = {wd / 1e9:.3f} GB. "
             f"Bus: one core alone B_1 = {bus['bus_alone'] / 1e9:.1f} GB/s, both cores together "
             f"B_2 = {bus['bus_total'] / 1e9:.1f} GB/s (B_2/B_1 = {bus['bus_total'] / bus['bus_alone']:.2f})"
             + (f"; the contention probe's target and draft together moved {max(achieved) / 1e9:.1f} GB/s at most"
                if achieved else "") + ".",
             "", "An SSD round in which every speculation is cached lasts at least max(T_v, (W_t + (K+1) W_d) / B_2) "
             "and yields at most SD's tokens per round at the same K, so the ceiling below bounds SSD's tok/s on "
             "this machine whatever its hit rate (T_v and SD's tokens per round measured at the same K, per dataset). "
             "xSD: against the fastest SD on one core for that dataset. floor ms above T_v means the bus, not the "
             "verification, sets the floor.", ""]
    caps = sorted({(r["k"], r["bus_cap"]) for r in rows})
    if caps:
        lines += ["Bus cap: if every pass streamed at B_1 (ideal kernels), SSD could be at most "
                        + ", ".join(f"{c:.2f}x (K={k})" for k, c in caps) + " as fast as SD at the same K "
                        "(at most min(1 + K W_d / W_t, B_2 / B_1)): faster kernels would speed up SD as much as "
                        "SSD and "
                        "leave SSD less room on this bus, not more.", ""]
    lines.append(table(["config", "T", "dataset", "K", "SD tok/rnd", "T_v ms", "floor ms", "ceiling tok/s",
                        "ceiling xSD",
                        "measured tok/s", "measured xSD", "of ceiling"],
                       [[r["config"], r["temperature"], r["group"], r["k"], fmt(r["sd_tokens_per_round"]),
                         fmt(r["verify_ms"], ".0f"),
                         fmt(r["floor_ms"], ".0f"), fmt(r["ceiling_tok_s"]), fmt(r["ceiling_x_sd"]),
                         fmt(r["measured_tok_s"]), fmt(r["measured_x_sd"]), fmt(r["measured_of_ceiling"])]
                        for r in rows]))
    return lines
