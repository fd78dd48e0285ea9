"""The rows of ``bench gpu --mode ssd`` (``benchmarks/bench_gpu_ssd.py``): one per measured configuration, the best of
each mode against the goals, Thm 2's prediction, and the projections of the real pair.

Glossary (per configuration and temperature; times are medians over rounds, in ms):
  * *verify* -- AR: the whole round; SD: the round less its drafting; SSD: the target's verification while the
    speculator thread builds the next cache beside it (the same device, its own CUDA stream on a GPU).
  * *verify alone* -- the same verification with nothing beside it: SD's at the same K (same rows, same code).
  * *pass* -- the bare target forward over K+1 rows, replayed on its own (``bench_gpu.pass_costs``).
  * *E_hit / E_miss* -- tokens a verification gave its sequence, in rounds whose speculation was a cache hit / miss.
  * *build* -- the speculator's build: the Python build, or the graph build (one graph replay per round,
    ``saguaro/ssd/graph_build.py``; on the paged backend only). *calls/build*: torch calls the host makes per build;
    *reads/round*: the speculator's device reads per round (``benchmarks/build_counters.py``, in a short counted run
    after the timed one).
  * *predicted* -- Thm 2 (``saguaro.theory.ssd_speedup``) for this configuration: the measured p_hit, E_hit and
    E_miss, with the round's times from the pass costs alone: t_v the K+1-row pass, T_p the build laid beside it
    (``calibration.timeline.build_time``), T_b the just-in-time drafting of a miss (``calibration.policy``). It
    assumes the build does not slow the verification: *beside / alone* measures whether that holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.bench_gpu import goal_row
from benchmarks.common import mean, ratio
from benchmarks.gpu_projection import gpu_timing
from saguaro.calibration.timeline import jit_draft_s
from saguaro.calibration.timeline import build_time
from saguaro.theory import ssd_speedup

GOALS = {"ssd_over_sd": 1.3, "ssd_over_sd_moonshot": 1.5, "ssd_over_ar": 2.0, "beside_over_alone": 1.2,
         "prediction_error": 0.10}


@dataclass(frozen=True)
class SSDShape:
    """What an SSD configuration's speculator builds: K, the fan-out F_0..F_K, the tapered tree's S."""
    k: int
    fan_out: list[int]
    branch_steps: int | None = None  # S: every branch this many steps, then ``deep`` branches on to K
    deep: int = 1

    @property
    def name(self) -> str:
        taper = f", tapered {self.branch_steps}+{self.deep}" if self.branch_steps else ""
        return f"SSD K={self.k} F=[{','.join(map(str, self.fan_out))}]{taper}"


@dataclass
class ConfigRow:
    """One configuration at one temperature (glossary above)."""
    name: str
    mode: str  # "ar", "sd" or "ssd"
    temperature: float
    k: int | None = None
    shape: SSDShape | None = None
    tok_s: float | None = None  # decode tokens per second, median over prompts
    tokens_per_round: float | None = None
    acceptance: float | None = None
    p_hit: float | None = None
    verify_ms: float | None = None
    verify_alone_ms: float | None = None
    verify_pass_ms: float | None = None
    beside_over_alone: float | None = None  # verify / verify alone (SSD; goal <= 1.2)
    build_ms: float | None = None
    wait_ms: float | None = None  # from sending the outcome to holding the next speculation (SSD)
    e_hit: float | None = None
    e_miss: float | None = None
    predicted_tok_s: float | None = None
    prediction_error: float | None = None  # predicted / measured - 1
    failure: str | None = None  # SSD: why its speculator failed; the row then measured n-gram SD and is failed
    build: str | None = None  # SSD: the speculator's build, "python" or "graph" (``ssd/graph_build.py``)
    priorities: str | None = None  # SSD on a GPU: stream priorities "off", "on" or "auto" (the engine's choice)
    lanes: dict | None = None  # SSD: the arrangement its speculator thread used and its source (``lane_profile``)
    torch_calls_per_build: float | None = None  # SSD: host torch calls per build, median (``build_counters``)
    device_reads_per_round: float | None = None  # SSD: the speculator's device reads per round


@dataclass
class Best:
    """The fastest SD and SSD configurations at one temperature, against AR and the goals."""
    temperature: float
    ar: str
    sd: str
    ssd: str
    ar_tok_s: float | None
    sd_tok_s: float | None
    ssd_tok_s: float | None
    ssd_over_sd: float | None
    ssd_over_ar: float | None
    beside_over_alone: float | None
    prediction_error: float | None


@dataclass
class ProjectionRow:
    """A **projection**: the real pair's CPU-measured acceptance and hit curves on one shape pair's pass costs
    measured on this device (``gpu_projection.project``); not a measurement of those models."""
    target: str
    draft: str
    target_step_ms: float  # the measured costs it rests on: one-row passes
    draft_step_ms: float
    temperature: float
    acceptance: float
    ar_tok_s: float
    sd_k: int
    sd_tok_s: float
    ssd_k: int
    ssd_tok_s: float
    ssd_fan_out: list[int]
    ssd_branch_steps: int | None
    ssd_p_hit: float
    ssd_x_sd: float
    ssd_x_ar: float


def lanes_text(lanes: dict | None) -> str:
    """A row's ``lanes`` in a table cell: priorities, the speculator's SMs and where that came from."""
    if not lanes:
        return "-"
    return f"prio {'on' if lanes['priorities'] else 'off'}, {lanes['sms'] or 'all'} SMs ({lanes['source']})"


def hit_miss_tokens(rounds: list[dict]) -> tuple[float | None, float | None]:
    """(E_hit, E_miss): mean tokens a verification emitted after a cache hit / a miss (``rounds.SSDRounds``)."""
    def tokens(hit: bool) -> float | None:
        return mean(r["emitted"] for r in rounds if r.get("hit") is hit and r.get("emitted") is not None)
    return tokens(True), tokens(False)


def thm2_tok_s(target_ms: dict[str, float], draft_ms: dict[str, float], shape: SSDShape, p_hit: float,
               e_hit: float, e_miss: float, sampled: bool) -> float:
    """Thm 2's tokens per second for ``shape`` at batch 1 from pass costs (ms per ``rows_N`` / ``tree_N``) and the
    measured hit rate and tokens per hit / miss round."""
    timing = gpu_timing(target_ms, draft_ms, shape.k)
    build = build_time(timing, shape.k, 1, sum(shape.fan_out), shape.branch_steps, shape.deep, sampled)
    t_miss = jit_draft_s(timing, shape.k, 1) / build.t_v
    return ssd_speedup(p_hit, e_hit, e_miss, build.t_hit, t_miss) / build.t_v


def config_row(name: str, mode: str, temperature: float, summary: dict[str, Any], rounds: list[dict],
               k: int | None = None, shape: SSDShape | None = None) -> ConfigRow:
    """A row from ``common.summarize_records``' summary (all prompts) and the configuration's rounds."""
    row = ConfigRow(name, mode, temperature, k, shape, summary.get("tok_s_median"), summary.get("tokens_per_round"),
                    summary.get("acceptance_rate"), summary.get("p_hit"), summary.get("verify_ms_median"))
    row.failure = summary.get("speculator_failure")
    if mode == "ssd":
        row.build_ms, row.wait_ms = summary.get("build_ms_median"), summary.get("wait_ms_median")
        row.e_hit, row.e_miss = hit_miss_tokens(rounds)
    return row


def complete(rows: list[ConfigRow], target_ms: dict[str, float], draft_ms: dict[str, float]) -> None:
    """Fill in what rows take from each other and from the pass costs: verification alone (SD's at the same K),
    the bare pass, the ratio beside / alone, and Thm 2's prediction for every SSD row."""
    sd = {(r.temperature, r.k): r for r in rows if r.mode == "sd"}
    for r in rows:
        if r.mode == "ar":
            continue
        r.verify_pass_ms = target_ms.get(f"rows_{r.k + 1}")
        alone = sd.get((r.temperature, r.k))
        r.verify_alone_ms = alone.verify_ms if alone else None
        if r.mode == "ssd":
            r.beside_over_alone = ratio(r.verify_ms, r.verify_alone_ms)
            if r.p_hit is not None and (r.e_hit or r.e_miss):
                e_hit = r.e_hit or r.e_miss  # a side never seen has no weight in Thm 2
                r.predicted_tok_s = thm2_tok_s(target_ms, draft_ms, r.shape, r.p_hit, e_hit, r.e_miss or e_hit,
                                               r.temperature > 0)
                r.prediction_error = (r.predicted_tok_s / r.tok_s - 1) if r.tok_s else None


def best_of(rows: list[ConfigRow]) -> list[Best]:
    """Per temperature: AR, the fastest SD (over K) and the fastest SSD (over K, fan-out and taper)."""
    out = []
    for t in dict.fromkeys(r.temperature for r in rows):
        at_t = [r for r in rows if r.temperature == t and r.failure is None]
        ar, sd, ssd = (max((r for r in at_t if r.mode == m), key=lambda r: r.tok_s or 0.0, default=None)
                       for m in ("ar", "sd", "ssd"))
        if ar is None or sd is None or ssd is None:
            continue
        out.append(Best(t, ar.name, sd.name, ssd.name, ar.tok_s, sd.tok_s, ssd.tok_s, ratio(ssd.tok_s, sd.tok_s),
                        ratio(ssd.tok_s, ar.tok_s), ssd.beside_over_alone, ssd.prediction_error))
    return out


def goal_rows(best: Best) -> list[list[str]]:
    """The one-GPU goals against this run's best configurations."""
    return [goal_row("SSD / SD (best of each)", best.ssd_over_sd, GOALS["ssd_over_sd"], "min"),
            goal_row("SSD / SD, moonshot", best.ssd_over_sd, GOALS["ssd_over_sd_moonshot"], "min"),
            goal_row("SSD / AR", best.ssd_over_ar, GOALS["ssd_over_ar"], "min"),
            goal_row("verification beside the build / alone (best SSD)", best.beside_over_alone,
                     GOALS["beside_over_alone"], "max"),
            goal_row("Thm 2 predicted / measured - 1 (best SSD)", best.prediction_error, GOALS["prediction_error"],
                     "abs")]
