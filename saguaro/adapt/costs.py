"""Pass costs for the K chooser: the calibration's row tables, kept fresh from the rounds the engine runs.

``target`` and ``draft`` are the profile's ``RowTimes`` tables (seconds for one forward over n rows, read by
``calibration.timeline.rows_time``): they give the costs' shape in the row count. Their level is measured: each
timed pass moves its table's scale toward (seconds taken / the table's prediction), an exponential average, so
the tables follow a machine that gets busier or quieter within a few rounds, and a profile in other units (the
documented defaults are relative to a verification) or from another machine is brought to this one's seconds.
One scale per table, so that the level follows at once whatever row count was timed. The shape in the row count
is the table's alone, measured for this CPU (the calibration's timed passes, or the default profile's row
curves), and never learnt from the rounds: one row count's timings cannot tell a change of load from what its
rows cost, and the rounds that time a second row count beside the first are those whose contention is priced
least well (a probe's build beside the AR step before it). Learnt per row count, it took those in: with an
int4 pair on avx2 it priced an AR step 16-30% above its time while a request speculated, and kept requests
speculating where AR was faster; the table's ratios were within 3% of the timed passes.
The first timing sets the scale outright (the target's sets the draft's too, until the
draft is timed itself: SD times its draft steps; SSD's drafts run in the speculator, whose builds, against their
prediction from the same table, give the draft's scale). ``build_pass_s``: one pass of an SSD round's cache build
(the glue, or a branch step), measured by the speculator; a build at K makes K + 1 of them, so its time grows
with the K asked of it (``build_s``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from saguaro.calibration.profile import RowTimes, Timing
from saguaro.calibration.timeline import RowCurve


@dataclass
class LiveCosts:
    target: RowTimes  # one target forward over n rows (a verification of K + 1 rows per sequence)
    draft: RowTimes  # one draft step over n rows (SD's proposer, SSD's just-in-time drafter)
    target_scale: float = 1.0
    draft_scale: float = 1.0
    build_pass_s: float | None = None  # SSD: one pass of the speculator's build (None: not yet measured)
    weight: float = 0.2  # share of a new observation in the averages
    timed: set[str] = field(default_factory=set)  # the scales set from a measurement: "target", "draft"
    curves: dict[str, RowCurve] = field(default_factory=dict, repr=False, compare=False)  # read every round

    @classmethod
    def from_timing(cls, timing: Timing) -> "LiveCosts":
        return cls(dict(timing.target_rows), dict(timing.draft_rows))

    def verify(self, rows: int) -> float:
        rows = max(rows, 1)
        return self.target_scale * self._rows_time("target", rows)

    def draft_step(self, rows: int) -> float:
        return self.draft_scale * self._rows_time("draft", max(rows, 1))

    def _rows_time(self, name: str, rows: int) -> float:
        """``rows_time`` of table ``name``: its curve is kept while the attribute holds the same dict."""
        table, curve = getattr(self, name), self.curves.get(name)
        if curve is None or curve.table is not table:
            curve = self.curves[name] = RowCurve.of(table)
        return curve(rows)

    def _scale(self, name: str, ratio: float) -> None:
        attr = f"{name}_scale"
        old = getattr(self, attr)
        setattr(self, attr, average(old if name in self.timed else None, ratio, self.weight))
        if name == "target" and "draft" not in self.timed:
            self.draft_scale = self.target_scale
        self.timed.add(name)

    def observe_verify(self, rows: int, seconds: float) -> None:
        """The level from every verification; the shape stays the table's (see the module's docstring)."""
        predicted = self._rows_time("target", rows) if rows > 0 else 0.0
        if seconds > 0 and predicted > 0:
            self._scale("target", seconds / predicted)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        """``steps`` draft passes, the widest over ``rows`` rows, took ``seconds`` in all."""
        predicted = self._rows_time("draft", rows) if rows > 0 and steps > 0 else 0.0
        if seconds > 0 and predicted > 0:
            self._scale("draft", seconds / steps / predicted)

    def observe_draft_scale(self, ratio: float) -> None:
        """A draft pass measured otherwise (SSD: a whole build over its prediction from this table), as the ratio
        of seconds taken to the table's prediction."""
        if ratio > 0:
            self._scale("draft", ratio)

    def observe_build(self, seconds: float, steps: int) -> None:
        """An SSD build of ``steps`` branch steps (after its glue) took ``seconds``."""
        if seconds > 0:
            per_pass = seconds / build_passes(steps)
            self.build_pass_s = average(self.build_pass_s, per_pass, self.weight)

    def build_s(self, max_k: int, prior_pass_s: float) -> np.ndarray:
        """[max_k + 1]: seconds of a build at K = 0..max_k (K + 1 passes; ``prior_pass_s`` a pass until one is
        measured)."""
        per_pass = self.build_pass_s if self.build_pass_s is not None else prior_pass_s
        return per_pass * build_passes(np.arange(max_k + 1))


def build_passes(k):
    """The passes of an SSD build of K = ``k`` steps (an int, or an array of Ks): its glue and K steps."""
    return np.maximum(k, 0) + 1.0


ZERO_WEIGHT = 0.05  # a round's share in ``ZeroRounds``' averages: they must span a probe's cycle (4-8 rounds) or two


@dataclass
class ZeroRounds:
    """SSD's rounds at K = 0 at one batch size, as they run: the mean time of them all, and of the plain ones (no
    probe's part beside them: no catch-up of a draft cache, no build for the probe after them), exponential
    averages. Their ratio is what a probe's parts add to a round at K = 0 (``cost``). It is taken against the
    plain rounds, not the AR step's price, as what every round of SSD pays (the post to the speculator, the
    chooser) is paid by a speculating round as well and is not K = 0's: on a tiny model the post alone is a
    verification's time. ``rounds`` and ``probes`` count the rounds and the probes sent from them, decayed alike,
    so their ratio is the rounds a probe follows in the averages' window, and what one probe's parts add
    (``probe_parts``) stays the same whatever the wait between probes."""
    all_s: float | None = None
    plain_s: float | None = None
    rounds: float = 0.0
    probes: float = 0.0

    def observe(self, seconds: float, beside_parts: bool) -> None:
        self.all_s = average(self.all_s, seconds, ZERO_WEIGHT)
        if not beside_parts:
            self.plain_s = average(self.plain_s, seconds, ZERO_WEIGHT)
        self.rounds = (1 - ZERO_WEIGHT) * self.rounds + 1.0
        self.probes *= 1 - ZERO_WEIGHT

    def probed(self, count: int = 1) -> None:
        """``count`` requests probe in the coming round, after rounds at K = 0 of this batch size."""
        self.probes += count

    def cost(self) -> float:
        """A round at K = 0 over a plain one (at least 1; 1 until both are timed)."""
        if self.all_s is None or self.plain_s is None:
            return 1.0
        return max(self.all_s / self.plain_s, 1.0)

    def probe_parts(self) -> float | None:
        """What one probe's parts add to the rounds at K = 0 before it, in plain rounds (None until a probe and
        both averages are measured)."""
        if self.all_s is None or self.plain_s is None or self.probes <= 0:
            return None
        return (self.cost() - 1.0) * self.rounds / self.probes


def average(old: float | None, new: float, weight: float) -> float:
    """An exponential average moved by ``new`` with ``weight`` (``new`` itself when there is none yet)."""
    return new if old is None else (1 - weight) * old + weight * new
