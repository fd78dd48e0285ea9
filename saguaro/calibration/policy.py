"""From a calibration profile to the engine's choices: fan-outs, budget, C, K and b* (paper Sec. 4).

Per temperature and batch size b, for each candidate per-sequence branch budget B:

* **Timing** (profile, seconds): the build glues the speculation (a draft pass over b rows: only each
  speculation's last token is fed) and then runs branch steps of b B rows each; a verification of the
  batch takes target(b (K+1) rows) alone. Side by side, each draft pass is slowed by the memory bus as
  the profile's probe measured for its width, and the verification advances at 1 / (the target's slowdown
  beside that pass), at full speed once the draft stops or while it works on a step's logits
  (``timeline.build_time``; no slowdown without a probe). A miss's just-in-time drafting runs while the
  target waits, at full speed. The speculator always runs one step and starts another only while the
  verification is still running, so a cached speculation has L <= K tokens, and a hit round lasts
  max(t_v, build).
* **Fan-out** for a speculation of length L (depths 0..L-1 and the all-accepted depth, which the engine
  stores at index K): Thm 12's geometric series (``theory.integer_geometric_fanout``) when the measured
  miss curve follows a power law (R^2 >= ``POWER_LAW_R2``), else Thm 13's optimum on the empirical per-depth
  curves (``theory.optimal_fanout``). Lists are chosen separately after a primary and after a backup
  speculation (F^p, F^b), each from its own curves and acceptance.
* **Hit rates**: p_hit,p = sum_k P(k) p_hit^k(F_k) (Appendix A, proof of Thm 13), P(k) the measured
  outcome law (the capped geometric law of acceptance a when none was measured); with the n-gram backup,
  p_hit,b likewise and the stationary p_hit = p_hit,b / (1 + p_hit,b - p_hit,p) (Thm 2); with the jit
  miss strategy every speculation is the primary's, so p_hit = p_hit,p.
* **Speedup**: Cor. 17 (``theory.ssd_speedup_batch``) with E_hit = sum_k P(k) (k + 1) for length L;
  E_miss the tokens of the round after a miss, measured per miss strategy over the calibration rounds that F^p
  would have missed (``miss_rounds``: misses fall where every speculator struggles), else the same sum
  for length K (jit) or the backup's tokens per round; T_p = hit-round time / t_v, T_b = miss drafting
  time / t_v.

**Tapered trees** (``branch_steps`` S < K): the build decodes all B branches for S steps, then only the
likeliest ``deep`` ones, one narrow pass per step, while the verification lasts. A hit on one of those
carries the longer speculation; their share of the hit probability is the top-``deep`` of
P(d) (p_hit^d(r + 1) - p_hit^d(r)) over the cached (depth, rank) outcomes (``deep_share``), and E_hit mixes
the two lengths. S = None (no taper) and every S < K are compared, like the budgets.

B is the budget with the best predicted speedup. The paper's B ("what the draft can finish during one
verification", after the glue) assumes K steps fit in a verification; on one CPU core they often do not
(the Qwen pair fits none), so the trade-off between more branches and shorter cached speculations is
optimized instead, with the same measured step costs. C (Def. 14) is the calibrated value with the best
predicted speedup (greedy: 1); K ("auto") the one with the best predicted speedup at b = 1; and b* comes
from ``theory.critical_batch_size`` (Thm 18) with the jit and n-gram options' measured quantities.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from saguaro.calibration.hits import (backup_weights, expected_round_tokens, fan_out_candidates, fan_out_for_budget,
                                      hit_side)
from saguaro.calibration.miss_rounds import miss_tokens
from saguaro.calibration.profile import Profile, TemperatureEntry
from saguaro.calibration.timeline import build_time, miss_draft_s, rows_time
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd_settings import MissStrategy, SSDSettings
from saguaro.theory import (choose_miss_strategy, critical_batch_size, expected_tokens, ssd_speedup_batch,
                            unconditional_hit_rate)

BUDGETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 40, 48, 64)


@dataclass
class Choice:
    """The predicted best configuration at one (temperature, batch size, miss strategy)."""
    batch: int
    miss_strategy: MissStrategy  # jit, ngram or skip
    budget: int
    steps: int  # L, tokens in a cached speculation (its every branch)
    primary: list[int]
    backup: list[int]
    method: str
    p_hit_p: float
    p_hit_b: float
    p_hit: float
    e_hit: float
    e_miss: float
    t_hit: float  # hit-round time / verification (T_p of Thm 2)
    t_miss: float  # miss drafting time / verification (T_b)
    verify_s: float
    speedup: float  # Cor. 17, tokens per verification time
    tok_s: float  # predicted per-sequence tokens per second
    speedup_vs_ar: float
    branch_steps: int | None = None  # S of a tapered tree (None: every branch gets the full build)
    deep_steps: int = 0  # tokens in the deep branches' cached speculations (tapered tree)
    deep_share: float = 0.0  # share of hits that land on a deep branch


def predict(profile: Profile, entry: TemperatureEntry, k: int, batch: int, budget: int, strategy: MissStrategy,
            vocab: int = 0, f_p: list[int] | None = None, f_b: list[int] | None = None,
            build_budget: int | None = None, branch_steps: int | None = None, deep: int = 1) -> Choice:
    """Thm 2 / Cor. 17 prediction (see module doc) with the jit or ngram miss strategy: for the fan-outs given,
    else the best over ``hits.fan_out_candidates`` for ``budget`` branches. The build is timed for
    ``build_budget`` branches (default ``budget``).

    The profile is read in three steps, each from its own module -- what the rounds cost (timeline.py), the
    fan-outs and what their hits deliver (hits.py), what a miss delivers (miss_rounds.py) -- and the rest is
    arithmetic here."""
    timing, primary, backup = profile.timing, entry.primary, entry.backup
    build = build_time(timing, k, batch, build_budget or budget, branch_steps, deep, sampled=entry.temperature > 0)
    t_miss = miss_draft_s(timing, strategy, k, batch) / build.t_v
    ar_step = rows_time(timing.target_rows, batch)
    if f_p is None:
        candidates = fan_out_candidates(primary, build.steps, build.deep_steps, k, budget, vocab)
        f_b = fan_out_for_budget(backup, k, k, budget, vocab, backup_weights(backup, k))[0]
    else:
        candidates = [(list(f_p), "given")]
    sides = [hit_side(primary, backup, f, f_b, build.steps, build.deep_steps, k, deep) for f, _ in candidates]
    skip = strategy == MissStrategy.SKIP  # a miss's round is an AR step: one token, nothing drafted
    measured = [None if skip else miss_tokens(primary, f, strategy) for f, _ in candidates]
    jit = strategy == MissStrategy.JIT
    choices = []
    for (f, method), side, e_measured in zip(candidates, sides, measured):
        e_miss = 1.0 if skip else e_measured or (
            side.e_all if jit else float(backup.tokens_per_round or expected_tokens(float(backup.acceptance), k)))
        p_p, p_b = side.p_hit_p, side.p_hit_b
        # after a skipped miss the build is the primary's, from the AR step's outcome: priced as after a hit
        p_hit = p_p if jit or skip or abs(p_p - p_b) >= 1 else float(unconditional_hit_rate(p_p, p_b))
        speedup = float(ssd_speedup_batch(p_hit, side.e_hit, e_miss, build.t_hit, t_miss, batch))
        tok_s = speedup / build.t_v
        choices.append(Choice(batch=batch, miss_strategy=strategy, budget=budget, steps=build.steps, primary=list(f),
                              backup=list(f_b), method=method, p_hit_p=p_p, p_hit_b=p_b, p_hit=p_hit,
                              e_hit=side.e_hit, e_miss=e_miss, t_hit=build.t_hit, t_miss=t_miss, verify_s=build.t_v,
                              speedup=speedup, tok_s=tok_s, speedup_vs_ar=tok_s * ar_step, branch_steps=branch_steps,
                              deep_steps=build.deep_steps, deep_share=side.deep_share))
    return max(choices, key=lambda c: c.tok_s)


def evaluate(profile: Profile, entry: TemperatureEntry, k: int, batch: int, budget: int, strategy: MissStrategy,
             vocab: int, branch_steps: int | None = None, deep: int = 1) -> Choice:
    """Predicted outcome of budget ``budget`` at ``batch`` with the jit or ngram miss strategy (see module doc)."""
    return predict(profile, entry, k, batch, budget, strategy, vocab, branch_steps=branch_steps, deep=deep)


def predict_fixed(profile: Profile, temperature: float, k: int, batch: int, f_p: list[int], f_b: list[int],
                  strategy: MissStrategy, c: float = 1.0, branch_steps: int | None = None, deep: int = 1) -> Choice:
    """Prediction for explicit fan-out lists at the nearest calibrated temperature (for measured-vs-theory)."""
    entry = entry_at(profile, temperature, c)
    return predict(profile, entry, k, batch, max(sum(f_p), sum(f_b)), MissStrategy.parse(strategy), f_p=f_p, f_b=f_b,
                   build_budget=sum(f_p), branch_steps=branch_steps, deep=deep)


def entry_at(profile: Profile, temperature: float, c: float = 1.0) -> TemperatureEntry:
    """The profile's entry for the calibrated temperature nearest ``temperature``, at the C nearest ``c``."""
    key = min(profile.temperatures, key=lambda t: abs(float(t) - temperature))
    return _entry_with_c(profile.temperatures[key], c)


def tree_shapes(k: int, taper: bool) -> list[int | None]:
    """branch_steps S to compare: the full tree (None), and with ``taper`` every S < K."""
    return [None] + (list(range(1, k)) if taper else [])


def best_choice(profile: Profile, entry: TemperatureEntry, k: int, batch: int, strategy: MissStrategy, vocab: int,
                shapes: list[int | None] = (None,), deep: int = 1) -> Choice:
    """The budget B and tree shape (``branch_steps`` among ``shapes``, ``deep`` branches past them) with the
    best predicted speed (tokens per second: t_v differs per budget, through contention)."""
    return max((evaluate(profile, entry, k, batch, b, strategy, vocab, s, deep) for b in BUDGETS for s in shapes),
               key=lambda c: c.tok_s)


def _choice(profile: Profile, entry: TemperatureEntry, k: int, batch: int, strategy: MissStrategy, vocab: int,
            fan_out: list[int] | None, shapes: list[int | None] = (None,), deep: int = 1) -> Choice:
    """``best_choice``, or with ``fan_out`` given for every cache the best of ``shapes`` for it alone."""
    if fan_out is None:
        return best_choice(profile, entry, k, batch, strategy, vocab, shapes, deep)
    return max((predict(profile, entry, k, batch, sum(fan_out), strategy, vocab, f_p=fan_out, f_b=fan_out,
                        branch_steps=s, deep=deep) for s in shapes), key=lambda c: c.tok_s)


def _entry_with_c(entry: TemperatureEntry, c: float) -> TemperatureEntry:
    """The temperature entry whose primary source is the one calibrated at the C nearest to ``c``."""
    options = [(1.0, entry.primary)] + [(float(s.c), s) for s in entry.c_sweep]
    nearest = min(options, key=lambda o: abs(o[0] - c))[1]
    return entry if nearest is entry.primary else replace(entry, primary=nearest)


def calibrated_cs(entry: TemperatureEntry) -> list[float]:
    return [1.0] + sorted(float(s.c) for s in entry.c_sweep)


def choose_c(profile: Profile, temperature: str, k: int, strategy: MissStrategy, vocab: int) -> float:
    """The calibrated C with the best predicted speedup at b = 1 (1 when no C < 1 was calibrated or greedy)."""
    entry = profile.temperatures[temperature]
    if float(temperature) <= 0:
        return 1.0
    return max(calibrated_cs(entry),
               key=lambda c: best_choice(profile, _entry_with_c(entry, c), k, 1, strategy, vocab).tok_s)


def critical_batch(profile: Profile, temperature: str, k: int, vocab: int, c: float = 1.0,
                   fan_out: list[int] | None = None) -> tuple[float, dict]:
    """Thm 18's b* (jit below, n-gram at or above) from the jit option's b = 1 prediction, with the best
    fan-outs for each option or the ``fan_out`` given for every cache."""
    entry = _entry_with_c(profile.temperatures[temperature], c)
    jit, ngram = (_choice(profile, entry, k, 1, m, vocab, fan_out) for m in (MissStrategy.JIT, MissStrategy.NGRAM))
    args = dict(p_hit=jit.p_hit, E_hit=jit.e_hit, T_p=jit.t_hit, E_miss_ngram=ngram.e_miss, T_ngram=ngram.t_miss,
                E_miss_jit=jit.e_miss, T_jit=jit.t_miss)
    try:
        b_star = critical_batch_size(**args)
    except ValueError:  # no threshold of the form "jit below b*": decide once
        b_star = math.inf if choose_miss_strategy(1, **args) == "jit" else 0.0
    return float(b_star), args


def sd_tokens_per_s(profile: Profile, entry: TemperatureEntry, k: int) -> float:
    """SD at b = 1: E(a_p, K) tokens per (K draft steps + one verification over K+1 rows)."""
    timing = profile.timing
    t = rows_time(timing.target_rows, k + 1) + k * rows_time(timing.draft_rows, 1)
    return expected_round_tokens(entry.primary, k) / t


def sd_speedup_vs_ar(profile: Profile, temperature: float, k: int) -> float:
    """Predicted SD speedup over AR at b = 1: ``sd_tokens_per_s`` times one target step."""
    return sd_tokens_per_s(profile, entry_at(profile, temperature), k) * rows_time(profile.timing.target_rows, 1)


def recommended_k(profile: Profile, strategy: MissStrategy = MissStrategy.JIT, vocab: int = 1 << 20, ks=range(1, 9),
                  mode: str = "ssd", taper: bool = False, deep: int = 1) -> int:
    """K with the best predicted speed at b = 1 (SSD: Cor. 17 per K, with tapered trees if ``taper``;
    SD: E / (1 + T_SD)), summed over the calibrated temperatures."""
    kind = _at_batch_one(strategy)
    entries = list(profile.temperatures.values())
    if mode == "sd":
        return max(ks, key=lambda k: sum(sd_tokens_per_s(profile, e, k) for e in entries))
    return max(ks, key=lambda k: sum(best_choice(profile, e, k, 1, kind, vocab, tree_shapes(k, taper), deep).tok_s
                                     for e in entries))


@dataclass
class TemperatureReport:
    c: float  # the Saguaro C chosen
    choice: Choice  # the prediction at b = 1


@dataclass
class PlanReport:
    """How a plan was chosen from a profile (logs and reports)."""
    default_profile: bool  # the documented defaults, not a measured profile
    b_star: float  # Thm 18's critical batch size (miss strategy "auto")
    thm18_inputs: dict[str, float]
    temperatures: dict[str, TemperatureReport] = field(default_factory=dict)

    def describe(self, strategy: MissStrategy) -> str:
        parts = []
        for t, r in self.temperatures.items():
            n = r.choice
            tree = f", tapered to {n.deep_steps} after {n.branch_steps}" if n.branch_steps else ""
            parts.append(f"T={t}: F^p={n.primary} F^b={n.backup} (B={n.budget}, L={n.steps}{tree}, {n.method}, "
                         f"p_hit,p={n.p_hit_p:.2f}, p_hit,b={n.p_hit_b:.2f}, C={r.c:.2f}, "
                         f"predicted {n.speedup_vs_ar:.2f}x AR)")
        if strategy == MissStrategy.AUTO:
            parts.append(f"b*={self.b_star:.2f}")
        return "; ".join(parts)


@dataclass
class CalibratedPlan:
    plan: SpecPlan
    report: PlanReport
    summary: str  # the report in one line, for the log


def _at_batch_one(strategy: MissStrategy) -> MissStrategy:
    """The strategy predictions use at b = 1: "auto" starts with jit; random is priced as the n-gram backup, skip
    as itself."""
    if strategy == MissStrategy.SKIP:
        return strategy
    return MissStrategy.JIT if strategy in (MissStrategy.JIT, MissStrategy.AUTO) else MissStrategy.NGRAM


def make_plan(profile: Profile, k: int, settings: SSDSettings, max_batch: int, vocab: int) -> CalibratedPlan:
    """The engine's plan for ``settings`` with some "auto": per temperature C, per batch size F^p and F^b, and
    b*; with ``branch_steps="auto"`` also the tree's branch_steps per temperature for ``deep_branches`` deep
    branches (chosen at b = 1, kept for every batch size). Explicit settings override their part."""
    temps = sorted(profile.temperatures, key=float)
    strategy, deep = settings.miss_strategy, settings.deep_branches
    cs = [choose_c(profile, t, k, _at_batch_one(strategy), vocab) if settings.saguaro_c == "auto"
          else float(settings.saguaro_c) for t in temps]  # greedy rows ignore C
    auto = strategy == MissStrategy.AUTO
    given = None if settings.fan_out == "auto" else settings.fan_out_for(k)
    b_star, thm18 = critical_batch(profile, temps[0], k, vocab, cs[0], given) if auto else (math.inf, {})
    report = PlanReport(profile.default, b_star, thm18)
    primary, backup, tapers = [], [], []
    # fan-outs per batch size only where they are chosen here: given ones need b = 1 alone (the taper, the report)
    batches = range(1, (max_batch if given is None else 1) + 1)
    for t, c in zip(temps, cs):
        entry = _entry_with_c(profile.temperatures[t], c)
        p_table, b_table, shapes = [], [], tree_shapes(k, settings.branch_steps == "auto")
        for b in batches:
            kind = (MissStrategy.JIT if b < b_star else MissStrategy.NGRAM) if auto else _at_batch_one(strategy)
            choice = _choice(profile, entry, k, b, kind, vocab, given, shapes, deep)
            p_table.append(choice.primary)
            b_table.append(choice.backup)
            if b == 1:
                shapes = [choice.branch_steps]
                tapers.append(choice.branch_steps)
                report.temperatures[t] = TemperatureReport(c, choice)
        primary.append(p_table)
        backup.append(b_table)
    if settings.fan_out != "auto":
        primary, backup = ([[settings.fan_out_for(k)] for _ in temps] for _ in range(2))
    if settings.branch_steps != "auto":
        tapers = [settings.branch_steps] * len(temps)
    summary = report.describe(strategy)
    plan = SpecPlan(k, [float(t) for t in temps], primary, backup, cs, strategy, b_star, tapers, deep)
    return CalibratedPlan(plan, report, summary)
