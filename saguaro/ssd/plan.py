"""The speculator's plan: fan-outs, Saguaro C and the miss strategy, looked up per round.

A ``SpecPlan`` is computed once by the engine (``saguaro.calibration.policy.make_plan`` from a calibration
profile, or ``SpecPlan.fixed`` from an explicit ``fan_out`` list) and shipped to the speculator process.
Every round the speculator asks it, per sequence:

* ``fan_out(temperature, drafted_by, batch)`` -- F_0..F_K for building the cache of a speculation that was
  drafted by the primary draft (``DraftedBy.PRIMARY``: a cache hit or just-in-time drafting) or by the
  point-mass backup (``DraftedBy.BACKUP``: n-gram / random), at the current batch size. Separate lists per
  drafter are the paper's F^p_k and F^b_k (Thm 12 / Thm 13); per batch size because the branch budget B is
  shared by the batch.
* ``c(temperature)`` -- the Saguaro sampling constant (Def. 14) for that temperature.
* ``branch_widths(n, temperature)`` -- how many of a sequence's n branches (likeliest first) each build step
  decodes: all of them for the first ``branch_steps`` steps, then only the ``deep_branches`` likeliest, up to
  K (a tapered tree; ``branch_steps`` None decodes every branch K steps).
* ``miss_strategy_for(batch)`` -- "jit" below the critical batch size b* and "ngram" at or above it when the
  miss strategy is "auto" (Thm 18); the configured one otherwise.

Beside its own tree (index 0) a plan may carry ``options``: other fan-out tables and tapers, a small set fixed
at start-up, among which the adaptive schedule picks one per round (``saguaro.adapt.trees``); the lookups take
the round's ``tree`` index. Every option is known before the first round, so the GPU build captures each
one's shapes at start-up (``graph_staging.startup_shapes``).

Temperatures are matched to the nearest calibrated one (greedy is temperature 0). ``MissStrategyTracker``
follows ``miss_strategy_for`` from round to round and logs each switch. How calibration chose a plan is
its own report (``saguaro.calibration.policy.PlanReport``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from saguaro.ssd_settings import DraftedBy, MissStrategy

log = logging.getLogger("saguaro.ssd")


@dataclass
class TreeOption:
    """One more cache tree a plan offers: fan-out tables and tapers laid out as the plan's own."""
    primary: list[list[list[int]]]  # [temperature index][batch - 1] -> F_0..F_K
    backup: list[list[list[int]]]
    branch_steps: list[int | None] | None = None  # per temperature (None: every branch is built for K steps)


@dataclass
class SpecPlan:
    k: int
    temperatures: list[float]  # sorted calibrated temperatures
    primary: list[list[list[int]]]  # [temperature index][batch - 1] -> F_0..F_K after a primary speculation
    backup: list[list[list[int]]]  # same, after a backup speculation
    c: list[float]  # Saguaro C per temperature
    miss_strategy: MissStrategy = MissStrategy.JIT
    b_star: float = math.inf  # "auto": jit for batch < b_star, n-gram otherwise
    branch_steps: list[int | None] | None = None  # per temperature: build steps that decode every branch (None: K)
    deep_branches: int = 1  # branches that go on past branch_steps, up to K tokens
    options: list[TreeOption] = field(default_factory=list)  # trees 1.. beside the plan's own (tree 0)

    def __post_init__(self) -> None:
        self.miss_strategy = MissStrategy(self.miss_strategy)  # a plan's name is typed already (SSDSettings)
        n = len(self.temperatures)
        if not n or len(self.c) != n:
            raise ValueError("a plan needs one fan-out table and one C per temperature")
        for tree in [self, *self.options]:
            if len(tree.primary) != n or len(tree.backup) != n:
                raise ValueError("a plan needs one fan-out table and one C per temperature")
            for table in tree.primary + tree.backup:
                if not table or any(len(f) != self.k + 1 or min(f) < 0 for f in table):
                    raise ValueError(f"every fan-out list needs K+1 = {self.k + 1} non-negative entries")
            if tree.branch_steps is not None and len(tree.branch_steps) != n:
                raise ValueError("a plan needs one branch_steps per temperature")
            if any(s is not None and not 1 <= s <= self.k for s in tree.branch_steps or []):
                raise ValueError(f"branch_steps must lie in [1, K = {self.k}], got {tree.branch_steps}")
        if self.deep_branches < 1:
            raise ValueError(f"deep_branches must be >= 1, got {self.deep_branches}")
        if any(not 0.0 <= c <= 1.0 for c in self.c):
            raise ValueError(f"Saguaro C must lie in [0, 1], got {self.c}")

    @classmethod
    def fixed(cls, fan_out: list[int], c: float = 1.0, miss_strategy: MissStrategy | str = MissStrategy.JIT,
              b_star: float = math.inf, branch_steps: int | None = None, deep_branches: int = 1) -> "SpecPlan":
        """One fan-out list for every temperature, drafter and batch size (the explicit ``fan_out=[...]``)."""
        return cls(len(fan_out) - 1, [0.0], [[list(fan_out)]], [[list(fan_out)]], [float(c)],
                   MissStrategy(miss_strategy), b_star, branch_steps=[branch_steps], deep_branches=deep_branches)

    @property
    def trees(self) -> int:
        """How many trees the plan offers: its own (0) and its options."""
        return 1 + len(self.options)

    def _tree(self, tree: int) -> "SpecPlan | TreeOption":
        if not 0 <= tree < self.trees:
            raise ValueError(f"tree {tree} is not one of the plan's {self.trees}")
        return self if tree == 0 else self.options[tree - 1]

    def branch_widths(self, n: int, temperature: float = 0.0, tree: int = 0) -> list[int]:
        """Branches decoded at each of the K build steps, for a sequence with ``n`` (likeliest first)."""
        steps = self.steps_for(temperature, tree)
        if n == 0:
            return []
        if steps is None:
            return [n] * self.k
        return [n] * steps + [min(n, self.deep_branches)] * (self.k - steps)

    def steps_for(self, temperature: float, tree: int = 0) -> int | None:
        """The tapered tree's S at ``temperature`` (None: every branch is built for K steps)."""
        steps = self._tree(tree).branch_steps
        return steps[self._index(temperature)] if steps else None

    def _index(self, temperature: float) -> int:
        return min(range(len(self.temperatures)), key=lambda i: abs(self.temperatures[i] - temperature))

    def fan_out(self, temperature: float, drafted_by: DraftedBy, batch: int = 1, tree: int = 0) -> list[int]:
        source = self._tree(tree)
        table = (source.primary if drafted_by == DraftedBy.PRIMARY else source.backup)[self._index(temperature)]
        return table[max(1, min(batch, len(table))) - 1]

    def c_for(self, temperature: float) -> float:
        return self.c[self._index(temperature)]

    def miss_strategy_for(self, batch: int) -> MissStrategy:
        if self.miss_strategy != MissStrategy.AUTO:
            return self.miss_strategy
        return MissStrategy.JIT if batch < self.b_star else MissStrategy.NGRAM

    def lists(self) -> list[list[int]]:
        """Every fan-out list of every tree."""
        return [f for tree in [self, *self.options] for table in tree.primary + tree.backup for f in table]

    def max_fan_out(self) -> int:
        return max(max(f) for f in self.lists())


class MissStrategyTracker:
    """The miss strategy from round to round: ``plan.miss_strategy_for`` at each round's batch size, each
    switch logged and kept in ``switches`` as (batch size, new strategy).

    The speculator follows it to draft its misses; the verifier's side keeps one too, for its round trace
    and its log: both see every round's batch size, so the two agree."""

    def __init__(self, plan: SpecPlan):
        self.plan = plan
        self.current = plan.miss_strategy_for(1)
        self.switches: list[tuple[int, MissStrategy]] = []

    def at(self, batch: int) -> MissStrategy:
        """The miss strategy for a round of ``batch`` sequences."""
        strategy = self.plan.miss_strategy_for(batch)
        if strategy != self.current:
            log.info("batch size %d: SSD miss strategy %s -> %s (b* = %.2f, Thm 18)", batch, self.current,
                     strategy, self.plan.b_star)
            self.switches.append((batch, strategy))
            self.current = strategy
        return strategy
