"""Pass costs for the K chooser: the calibration's row tables, kept fresh from the rounds the engine runs.

``target`` and ``draft`` are ``RowTimes`` tables (seconds for one forward over n rows, read by
``calibration.timeline.rows_time``), copied from the profile and updated as rounds are timed: an observed
pass over n rows moves entry n toward its time (an exponential average, so a machine that gets busier or
quieter shows within a few rounds). The profile's tables may be in other units (the documented defaults are
relative to a verification) or from another machine or load: the first pass timed rescales its table (the
target's first scales the draft's too, until the draft is timed), keeping the profile's shape and taking the
measured level. ``build_s``: an SSD round's cache build, measured by the speculator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from saguaro.calibration.profile import RowTimes, Timing
from saguaro.calibration.timeline import rows_time


def _observe(table: RowTimes, rows: int, seconds: float, weight: float) -> None:
    key = str(rows)
    old = table.get(key)
    table[key] = seconds if old is None else (1.0 - weight) * old + weight * seconds


@dataclass
class LiveCosts:
    target: RowTimes  # one target forward over n rows (a verification of K + 1 rows per sequence)
    draft: RowTimes  # one draft step over n rows (SD's proposer, SSD's just-in-time drafter)
    build_s: float | None = None  # SSD: the speculator's build beside a verification (None: not yet measured)
    weight: float = 0.3  # share of a new observation in the average
    rounds: int = 0  # rounds observed
    timed: set[str] = field(default_factory=set)  # the tables rescaled to a measurement: "target", "draft"

    @classmethod
    def from_timing(cls, timing: Timing) -> "LiveCosts":
        return cls(dict(timing.target_rows), dict(timing.draft_rows))

    def verify(self, rows: int) -> float:
        return rows_time(self.target, max(rows, 1))

    def draft_step(self, rows: int) -> float:
        return rows_time(self.draft, max(rows, 1))

    def _first(self, name: str, rows: int, seconds: float) -> None:
        """Rescale table ``name`` (and the draft's with the target's, if not timed yet) to its first timing."""
        if name in self.timed:
            return
        table = self.target if name == "target" else self.draft
        predicted = rows_time(table, rows)
        factor = seconds / predicted if predicted > 0 else 1.0
        tables = [table] if name == "draft" or "draft" in self.timed else [self.target, self.draft]
        for scaled in tables:
            scaled.update({key: v * factor for key, v in scaled.items()})
        self.timed.add(name)

    def observe_verify(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.rounds += 1
            self._first("target", rows, seconds)
            _observe(self.target, rows, seconds, self.weight)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        """``steps`` draft passes, the widest over ``rows`` rows, took ``seconds`` in all."""
        if rows > 0 and steps > 0 and seconds > 0:
            self._first("draft", rows, seconds / steps)
            _observe(self.draft, rows, seconds / steps, self.weight)

    def observe_build(self, seconds: float) -> None:
        if seconds > 0:
            self.build_s = seconds if self.build_s is None else (1 - self.weight) * self.build_s + self.weight * seconds
