"""How long a round's build and verification take side by side, from a profile's measured costs.

``rows_time`` reads a measured cost table (seconds per forward over n rows), ``slowdowns`` the memory-bus
contention the profile's probe measured (``contention.measure``). ``build_time`` lays the draft's build and
the target's verification on one timeline with both; the policy (``policy.py``) turns its result into
hit-round times and cached speculation lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from saguaro.calibration.profile import RowTimes, Timing
from saguaro.ssd_settings import MissStrategy


def rows_time(table: RowTimes, n: float) -> float:
    """Seconds for a forward over ``n`` rows: piecewise-linear in the measured points, linear beyond them."""
    return RowCurve.of(table)(n)


@dataclass
class RowCurve:
    """``rows_time`` over one table, its points sorted once and each row count's time kept: the K chooser reads
    a few row counts of the same tables every round. ``table`` is the dict it was made from (``LiveCosts``
    checks it is still the one it holds)."""
    table: RowTimes
    xs: list[int]
    ys: list[float]
    known: dict[float, float] = field(default_factory=dict)

    @classmethod
    def of(cls, table: RowTimes) -> "RowCurve":
        pts = sorted((int(k), float(v)) for k, v in table.items())
        return cls(table, [p[0] for p in pts], [p[1] for p in pts])

    def __call__(self, n: float) -> float:
        t = self.known.get(n)
        if t is None:
            t = self.known[n] = self._at(n)
        return t

    def _at(self, n: float) -> float:
        xs, ys = self.xs, self.ys
        if n <= xs[0] or len(xs) == 1:
            return ys[0]
        if n >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(slope, 0.0) * (n - xs[-1])
        return float(np.interp(n, xs, ys))


def slowdowns(timing: Timing, draft_rows: float) -> tuple[float, float]:
    """(target, draft) slowdown factors while the draft runs ``draft_rows``-row passes beside a verification.

    Read from the probe stored in ``timing.contention``, interpolated in the draft width (clamped to the
    widths probed); the draft's factor compares its busy pass rate with its own time alone
    (``timing.draft_rows``). (1, 1) when the profile has no probe."""
    probe = timing.contention
    if probe is None or not probe.busy:
        return 1.0, 1.0
    pts = sorted(probe.busy, key=lambda b: b.draft_rows)
    xs = [b.draft_rows for b in pts]
    target = float(max(1.0, np.interp(draft_rows, xs, [b.slowdown for b in pts])))  # clamps at the ends
    alone = [rows_time(timing.draft_rows, b.draft_rows) for b in pts]
    draft = [1.0 / (b.draft_passes_per_s * a) if b.draft_passes_per_s > 0 else 1.0 for b, a in zip(pts, alone)]
    return target, float(max(1.0, np.interp(draft_rows, xs, draft)))


@dataclass
class BuildTime:
    steps: int  # L: build steps that decode every branch
    deep_steps: int  # L plus the narrow steps after them (tapered tree; = L without one)
    t_hit: float  # hit-round time / t_v
    t_v: float


def step_overhead(timing: Timing, rows: int, sampled: bool) -> float:
    """Seconds a build step spends on its logits besides the forward (ranked ids, and the distributions and
    draw when ``sampled``); 0 for a profile that did not time it."""
    overhead = timing.step_overhead
    table = None if overhead is None else overhead.sampled if sampled else overhead.greedy
    return rows_time(table, rows) if table else 0.0


def build_widths(k: int, batch: int, rows: int, branch_steps: int | None = None, deep: int = 1) -> list[int]:
    """The rows of each pass of a build of K steps: the glue, one row per sequence (a speculation from the draft
    arrives with its k/v and ranked ids; only its last token is fed), then ``rows`` per sequence for the first
    ``branch_steps`` steps (all of them when None) and ``deep`` after them (a tapered tree)."""
    full = k if branch_steps is None else min(branch_steps, k)
    return [batch] + [batch * max(rows, 1)] * full + [batch * deep] * (k - full)


def build_pass(timing: Timing, width: int, step: bool, sampled: bool) -> tuple[float, float]:
    """(the forward of a build pass ``width`` rows wide beside a verification, slowed by the bus as the profile
    measured (``slowdowns``); a step's own logits work after it (``step_overhead``; none for the glue))."""
    dur = rows_time(timing.draft_rows, width) * slowdowns(timing, width)[1]
    return dur, step_overhead(timing, width, sampled) if step else 0.0


def build_cost(timing: Timing, max_k: int, batch: int, rows: int, branch_steps: int | None = None,
               deep: int = 1, sampled: bool = False) -> np.ndarray:
    """[max_k + 1]: seconds of a whole build of K = 0..max_k steps beside a verification, each pass at its width
    (``build_widths``, ``build_pass``). The wide steps come first, so a shallow build of a wide tree costs more
    per pass than the whole tree's mean."""
    widths = build_widths(max_k, batch, rows, branch_steps, deep)
    return np.cumsum([sum(build_pass(timing, w, i > 0, sampled)) for i, w in enumerate(widths)])


def build_time(timing: Timing, k: int, batch: int, rows: int, branch_steps: int | None = None,
               deep: int = 1, sampled: bool = False, verify_rows: float | None = None) -> BuildTime:
    """Steps a build completes when each branch step decodes ``rows`` rows per sequence (the first
    ``branch_steps`` of them, then ``deep`` rows: a tapered tree), and how long the verification takes.

    The two run side by side: the draft makes its passes (the glue, then the steps), each slowed by the
    memory bus as the profile measured for its width (``slowdowns``; none without a probe), and
    meanwhile the verification advances at 1 / (the target's slowdown beside a pass of that width); once
    the draft stops, or while it works on a step's logits (``step_overhead``, no bus traffic to speak
    of), at full speed. ``sampled``: the steps draw from distributions (temperature > 0). The first step
    always runs, a later one only starts while the verification is still running. The verification is of
    K + 1 rows per sequence, or ``verify_rows`` (a build deeper than the K its batch verifies)."""
    t_alone = rows_time(timing.target_rows, batch * (k + 1) if verify_rows is None else verify_rows)
    full = k if branch_steps is None else branch_steps
    widths = build_widths(k, batch, rows, branch_steps, deep)
    clock = work = 0.0  # wall time of the draft, verification work done (in uncontended seconds)
    t_v = None
    passes = 0
    for i, width in enumerate(widths):
        if i >= 2 and t_v is not None:
            break
        slow_target = slowdowns(timing, width)[0]
        dur, extra = build_pass(timing, width, i > 0, sampled)  # the forward beside the verification; its logits
        if t_v is None and work + dur / slow_target >= t_alone:
            t_v = clock + (t_alone - work) * slow_target
        work += dur / slow_target
        if t_v is None and work + extra >= t_alone:
            t_v = clock + dur + (t_alone - work)
        work += extra
        clock += dur + extra
        passes += 1
    if t_v is None:
        t_v = clock + (t_alone - work)
    done = passes - 1
    return BuildTime(min(done, full), done, clock / t_v, t_v)


def jit_draft_s(timing: Timing, k: int, batch: int) -> float:
    """Seconds a miss's just-in-time drafting keeps the target waiting: a first draft pass over two rows per
    sequence (it catches up on the verified tokens), then K - 1 one-row steps."""
    return rows_time(timing.draft_rows, 2 * batch) + (k - 1) * rows_time(timing.draft_rows, batch)


def miss_draft_s(timing: Timing, strategy: MissStrategy, k: int, batch: int) -> float:
    """Seconds a miss's drafting keeps the target waiting: just in time (``jit_draft_s``), or the n-gram
    backup's host time per sequence; none for a skipped miss."""
    if strategy == MissStrategy.JIT:
        return jit_draft_s(timing, k, batch)
    if strategy == MissStrategy.SKIP:
        return 0.0
    return batch * float(timing.ngram_s)
