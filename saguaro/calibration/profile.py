"""The calibration profile of a target/draft pair: its schema as typed dataclasses, and the defaults.

``saguaro calibrate`` measures a ``Profile`` (``measure.calibrate``); ``store.py`` keeps it as JSON
(``Profile.to_dict``: the same fields, nested the same way) and reads it back for the engine's "auto"
settings; ``policy.py`` plans from it. ``PROFILE_VERSION`` changes whenever the layout does: a stored
profile of another version, of none, or whose keys do not match these classes is refused with a message
to re-run ``saguaro calibrate`` (``ProfileError``, logged by ``store.load_profile``).

Glossary:
  * *source*: what follows one kind of speculation, measured over a calibration run's rounds: after the
    *primary* (the draft model; jit miss strategy, empty cache) or the *backup* (the n-gram matcher). Its
    acceptance a_p / a_b, its outcome law and its per-depth hit curves (``Source``).
  * *depth* d of an outcome: d drafted tokens accepted (d < K: the bonus token replaced d_{d+1}); the
    all-accepted outcome of any length is stored at index K, as the engine's fan-out lists do.
  * *row table* (``RowTimes``): {"n": seconds for one forward over n new rows after a cached context};
    keys are strings, as in the JSON; ``timeline.rows_time`` interpolates it.

Defaults (no profile; the engine logs that it used them), chosen from the CPU testbed's measured numbers and the
paper's fits: primary a_p = 0.75 with r_p = 0.6, backup a_b = 0.3 with r_b = 0.4 at every temperature; a
draft row costs 0.38 of a verification, a draft step over n rows costs 0.38 (1 + 0.035 (n - 1)) and a
verification over n rows 1 + 0.02 (n - 1) target rows; n-gram time 0. On the CPU's kernels the pair's own
weight bytes and the kernels' measured row curves replace the ratio and the slopes (``PairCosts``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from saguaro.config import DTYPES
from saguaro.profile_files import ProfileError, checked_fields

PROFILE_VERSION = 1
F_MAX = 64  # hit curves are stored for fan-outs 0..F_MAX
POWER_LAW_R2 = 0.9  # the power law "fits" when R^2 on log-log axes reaches this
DEFAULTS = {"a_p": 0.75, "r_p": 0.6, "a_b": 0.3, "r_b": 0.4, "draft_ratio": 0.38, "draft_slope": 0.035,
            "target_slope": 0.02}
ROW_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)

RowTimes = dict[str, float]  # "n" -> seconds for one forward over n new rows (see the glossary)


@dataclass
class StepOverhead:
    """Seconds a build step spends on its logits besides the forward, per step width in rows
    (``measure.time_step_overhead``)."""
    greedy: RowTimes  # the draft's ranked ids and the argmax
    sampled: RowTimes  # ranked ids, the processed distributions and a seeded draw


@dataclass
class BusyDraft:
    """One phase of the contention probe: the target verifies while the draft runs ``draft_rows``-row passes
    back to back on the other core."""
    draft_rows: int
    slowdown: float  # median verification time / its median with the other core idle
    draft_passes_per_s: float  # the busy draft's pass rate meanwhile
    verify_ms: list[float] = field(default_factory=list)  # each verification timed (reps)
    verify_ms_median: float = 0.0
    bus_bytes_per_s: float = 0.0  # what the bus carried: target bytes per verification + draft bytes per pass


@dataclass
class ContentionProbe:
    """How much a busy draft on the other core slows the target's verification (``contention.measure``;
    ``timeline.slowdowns`` reads it)."""
    busy: list[BusyDraft]  # one per draft width probed
    description: str = ""
    rows: int = 0  # rows of the verification timed (K + 1)
    context: int = 0  # tokens cached before them
    reps: int = 0  # verifications timed per phase
    enforce_eager: bool = True  # False: both models on the bf16 fast path
    draft_format: str = ""  # DraftFormat.tag of the busy draft
    target_cores: list[int] | None = None
    draft_cores: list[int] | None = None
    target_pass_bytes: int = 0  # weight bytes one pass streams (bus.pass_bytes)
    draft_pass_bytes: int = 0
    idle_ms_before: list[float] = field(default_factory=list)  # verifications with the other core idle
    idle_ms_after: list[float] = field(default_factory=list)
    idle_ms_median: float = 0.0
    loadavg: list[float] | None = None  # the machine's load meanwhile (other tenants load the bus too)

    @classmethod
    def from_dict(cls, data: dict) -> ContentionProbe:
        d = checked_fields(cls, data, "timing.contention")
        d["busy"] = [BusyDraft(**checked_fields(BusyDraft, b, "timing.contention.busy")) for b in d["busy"]]
        return cls(**d)


@dataclass
class Timing:
    """Seconds, one process on one core, min over repeats (``measure.measure_timing``)."""
    target_rows: RowTimes  # one target forward over n new rows (n = K+1 is a verification)
    draft_rows: RowTimes  # one draft forward over n new rows (a branch step of n rows, or a glue)
    ngram_s: float  # one n-gram proposal of K tokens
    verify_s: float  # target over K+1 rows
    draft_step_s: float  # draft over 1 row
    T_p: float  # K draft steps / verification (SD's T_SD, Thm 2)
    T_b: float  # n-gram proposal / verification
    context: int | None = None  # tokens cached before the timed rows (the prompts' mean length)
    repeats: int | None = None
    raw: dict[str, RowTimes] | None = None  # "target", "draft": the row tables before ``measure.monotone``
    step_overhead: StepOverhead | None = None  # None: not timed (taken as 0)
    contention: ContentionProbe | None = None  # None: not probed (no slowdown assumed)

    @classmethod
    def from_dict(cls, data: dict) -> Timing:
        d = checked_fields(cls, data, "timing")
        if d.get("step_overhead") is not None:
            d["step_overhead"] = StepOverhead(**checked_fields(StepOverhead, d["step_overhead"],
                                                                "timing.step_overhead"))
        if d.get("contention") is not None:
            d["contention"] = ContentionProbe.from_dict(d["contention"])
        return cls(**d)


@dataclass
class Source:
    """What follows one kind of speculation (glossary), from a run's rank records (``measure.summarize_source``).
    A Saguaro C sweep point is a primary source with ``c`` and ``fan_out`` set."""
    # a_p or a_b: P(a drafted token is accepted | all earlier ones were), the MLE accepted / (accepted +
    # rejections) of Thm 2's capped geometric model
    acceptance: float = 0.0
    hit_curves: list[list[float]] = field(default_factory=list)  # K+1 lists: [d][F] = p_hit^d(F), F = 0..F_MAX
    outcome_pmf: list[float] = field(default_factory=list)  # P(k accepted), k = 0..K, full-length speculations
    depth_pmf: list[float] = field(default_factory=list)  # P(the outcome lands at depth d), d = 0..K, all rounds
    tokens_per_round: float | None = None  # accepted + bonus per round (E_hit / E_miss as measured)
    accepted_per_drafted: float | None = None  # the engine's acceptance_rate
    acceptance_by_position: list[float] = field(default_factory=list)
    rounds: int = 0
    ranked_rounds: int = 0  # rounds whose bonus token's rank was known
    miss_uniform: list[float] = field(default_factory=list)  # [F]: miss rate with F at every depth (paper fig. 3)
    r: float | None = None  # power-law exponent (Def. 11, theory.fit_power_law); None: no miss at any F >= 1
    r2: float = 0.0  # its fit on log-log axes
    power_law: bool = False  # r2 >= POWER_LAW_R2
    r_free: float | None = None  # the free fit miss = prefactor F^-r_free and its R^2 (measure.free_power_law)
    prefactor: float | None = None
    r2_free: float | None = None
    # primary sources: per ranked round [depth, rank, jit tokens, n-gram tokens] of the round after it
    # (miss_rounds.follow_ups)
    follow_ups: list[list[int]] = field(default_factory=list)
    c: float | None = None  # a C sweep point: the Saguaro C and the fan-out the primary ran with
    fan_out: list[int] | None = None


@dataclass
class TemperatureEntry:
    """The sources measured at one temperature."""
    primary: Source  # rounds after a speculation drafted by the draft model
    backup: Source  # rounds after one from the n-gram backup
    c_sweep: list[Source] = field(default_factory=list)  # the primary again at each Saguaro C < 1 (T > 0 only)
    temperature: float = 0.0

    @classmethod
    def from_dict(cls, data: dict, where: str) -> TemperatureEntry:
        d = checked_fields(cls, data, where)
        for name in ("primary", "backup"):
            d[name] = Source(**checked_fields(Source, d[name], f"{where}.{name}"))
        d["c_sweep"] = [Source(**checked_fields(Source, s, f"{where}.c_sweep")) for s in d.get("c_sweep", [])]
        return cls(**d)


@dataclass
class Profile:
    """Everything ``saguaro calibrate`` measured for one (target and its weight format, draft and its format,
    dtype, fast path, workload); ``store.profile_path`` keys the file by the same."""
    target: str
    draft: str
    dtype: str  # "float32", "bfloat16", ...
    k: int  # K used to calibrate
    timing: Timing
    temperatures: dict[str, TemperatureEntry]  # keyed str(float(T)): "0.0", "1.0", ...
    version: int = PROFILE_VERSION
    default: bool = False  # the documented defaults, not a measurement
    draft_format: str = ""  # DraftFormat.tag the draft ran as ("": bf16, full head)
    target_weights: str = "bf16"  # the target's packed weights (Config.target_weights): its costs follow them
    workload: str = "mixed"  # the held-out prompts (config.WORKLOADS)
    enforce_eager: bool = True  # False: timed on the bf16 fast path (Config.enforce_eager)
    kernels: str = ""  # the CPU kernel tier the fast path timed ("": not recorded, or not on the CPU kernels)
    created: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # how calibrate ran: prompts, tokens, batch, ...

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """The profile in ``data`` (parsed JSON). Raises ``ProfileError`` for another version or layout."""
        version = data.get("version") if isinstance(data, dict) else None
        if version is None:
            raise ProfileError("it has no version (written before profiles had one)")
        if version != PROFILE_VERSION:
            raise ProfileError(f"it is version {version}, this engine reads version {PROFILE_VERSION}")
        d = checked_fields(cls, data, "profile")
        d["timing"] = Timing.from_dict(d["timing"])
        d["temperatures"] = {t: TemperatureEntry.from_dict(e, f"temperatures[{t}]")
                             for t, e in d["temperatures"].items()}
        return cls(**d)


def dtype_name(dtype) -> str:
    return str(DTYPES.get(dtype, dtype)).replace("torch.", "")


def power_law_source(a: float, r: float, k: int) -> Source:
    """A source whose hit curves follow 1 - F^{-r} at every depth (Def. 11), acceptance a."""
    f = np.arange(F_MAX + 1, dtype=float)
    hit = np.where(f > 0, 1.0 - np.maximum(f, 1.0) ** (-r), 0.0)
    pmf = [a ** j * (1 - a) for j in range(k)] + [a ** k]
    return Source(rounds=0, ranked_rounds=0, acceptance=a, accepted_per_drafted=None,
                  acceptance_by_position=[a] * k, tokens_per_round=float(sum(a ** j for j in range(k + 1))),
                  outcome_pmf=pmf, depth_pmf=pmf, hit_curves=[hit.tolist()] * (k + 1),
                  miss_uniform=(1.0 - hit).tolist(), r=r, r2=1.0, power_law=True)


@dataclass
class PairCosts:
    """What the defaults know of a pair's passes without a calibration (``calibration.pair_cost``); None: the
    DEFAULTS' guess."""
    draft_ratio: float | None = None  # a draft step over a target step, one row each
    target_rows: dict[int, float] | None = None  # a target pass over n rows / over one row, n in ROW_GRID
    draft_rows: dict[int, float] | None = None  # the same for a draft pass


def model_timing(k: int, verify_s: float = 1.0, costs: PairCosts | None = None) -> Timing:
    """The default timing table (relative units, a verification = ``verify_s``), with what ``costs`` knows: the
    row curves (else DEFAULTS' slopes), and a draft step's cost against a 1-row target step (else DEFAULTS'
    ratio to a verification)."""
    d, costs = DEFAULTS, costs or PairCosts()
    target_curve = costs.target_rows or {n: 1 + d["target_slope"] * (n - 1) for n in ROW_GRID}
    draft_curve = costs.draft_rows or {n: 1 + d["draft_slope"] * (n - 1) for n in ROW_GRID}
    one_row = verify_s / float(np.interp(k + 1, ROW_GRID, [target_curve[n] for n in ROW_GRID]))  # K + 1 off the grid
    target = {str(n): one_row * target_curve[n] for n in ROW_GRID}
    step = verify_s * d["draft_ratio"] if costs.draft_ratio is None else one_row * costs.draft_ratio
    draft = {str(n): step * draft_curve[n] for n in ROW_GRID}
    return Timing(target_rows=target, draft_rows=draft, ngram_s=0.0, verify_s=verify_s, draft_step_s=step,
                  T_p=k * step / verify_s, T_b=0.0)


def default_profile(target: str, draft: str, dtype, k: int = 4, costs: PairCosts | None = None) -> Profile:
    """The documented defaults (``default=True``), for greedy and temperature 1, with what ``costs`` knows of
    the pair's passes (``calibration.pair_cost``)."""
    d = DEFAULTS
    primary, backup = power_law_source(d["a_p"], d["r_p"], k), power_law_source(d["a_b"], d["r_b"], k)
    return Profile(target=str(target), draft=str(draft), dtype=dtype_name(dtype), k=k,
                   timing=model_timing(k, costs=costs),
                   temperatures={t: TemperatureEntry(primary, backup, temperature=float(t)) for t in ("0.0", "1.0")},
                   default=True, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
