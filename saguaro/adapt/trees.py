"""The cache trees an SSD schedule chooses among, beside the plan's own, fixed once at start-up.

``tree_options`` derives them from the plan and the calibration profile (``AdaptSettings`` picks which):

* the plan's fan-outs scaled (a budget of s B branches, the plan's shape kept): a cheaper build where the
  bus or a low hit rate makes branches cost more than they return, a wider one where they pay;
* Thm 12's geometric shape at the plan's budget for a few acceptances a (``theory.integer_geometric_fanout``,
  with the profile's power-law exponent r): a request that accepts little wants its guesses at the shallow
  outcomes, one that accepts much wants them deep and at the all-accepted outcome;
* the plan's fan-outs under the other taper: S = 1 step over every branch, then the plan's ``deep_branches``
  on to K, where the plan builds every branch K steps, and the full tree where the plan tapers.

Every option is a full set of tables (per temperature and batch size, after a primary and after a backup
speculation), so the speculator looks them up as it looks up the plan's, and the set is known before the
first round: the GPU build captures each tree's shapes at start-up. Options equal to the plan's tree or to
an earlier option are left out.
"""
from __future__ import annotations

import numpy as np

from saguaro.adapt_settings import AdaptSettings
from saguaro.calibration.policy import entry_at
from saguaro.calibration.profile import DEFAULTS, F_MAX, Profile
from saguaro.ssd.plan import SpecPlan, TreeOption
from saguaro.theory import integer_geometric_fanout, round_fanout

Table = list[list[list[int]]]  # [temperature index][batch - 1] -> F_0..F_K


def scaled(fan_out: list[int], scale: float) -> list[int]:
    """The plan's shape at ``scale`` times its budget (largest-remainder rounding, at least one branch)."""
    budget = max(1, round(sum(fan_out) * scale))
    return [int(f) for f in round_fanout(np.asarray(fan_out, dtype=float) * scale, min(budget, F_MAX * len(fan_out)),
                                         F_MAX)]


def geometric(fan_out: list[int], acceptance: float, r: float) -> list[int]:
    """Thm 12's fan-outs for ``acceptance`` at the budget of ``fan_out`` (K = its length - 1)."""
    budget = min(sum(fan_out), F_MAX * len(fan_out))
    if budget == 0:
        return list(fan_out)
    return [int(f) for f in integer_geometric_fanout(acceptance, r, len(fan_out) - 1, budget, F_MAX)]


def _exponent(profile: Profile, temperature: float) -> float:
    """The profile's power-law exponent r of the primary's hit curve (its default where none was fitted)."""
    r = entry_at(profile, temperature).primary.r
    return float(r) if r and r > 0 else float(DEFAULTS["r_p"])


def _map(plan: SpecPlan, table: Table, change) -> Table:
    """``table`` with ``change(fan_out, temperature)`` applied to every list."""
    return [[change(list(f), t) for f in rows] for rows, t in zip(table, plan.temperatures)]


def tree_options(plan: SpecPlan, profile: Profile, settings: AdaptSettings) -> list[TreeOption]:
    """The trees beside ``plan``'s own (see the module docstring); [] when ``settings`` asks for none."""
    def option(change, steps=None) -> TreeOption:
        return TreeOption(_map(plan, plan.primary, change), _map(plan, plan.backup, change),
                          plan.branch_steps if steps is None else steps)

    found: list[TreeOption] = []
    for s in settings.fan_out_scales:
        found.append(option(lambda f, t, s=s: scaled(f, s)))
    for a in settings.fan_out_shapes:
        found.append(option(lambda f, t, a=a: geometric(f, a, _exponent(profile, t))))
    if settings.taper and plan.k > 1:
        tapers = plan.branch_steps or [None] * len(plan.temperatures)
        found.append(option(lambda f, t: f, [1 if s is None else None for s in tapers]))
    seen = [_key(plan)]
    options = []
    for tree in found:
        if _key(tree) not in seen and any(sum(f) for table in tree.primary for f in table):
            seen.append(_key(tree))
            options.append(tree)
    return options


def _key(tree: SpecPlan | TreeOption) -> tuple:
    steps = tuple(tree.branch_steps or [None] * len(tree.primary))
    return (str(tree.primary), str(tree.backup), steps)
