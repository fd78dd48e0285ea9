"""The engine's K schedule from its Config: adaptive by default, from the pair's calibration profile.

The profile (``calibration.store.resolve_profile``: the stored one, or the documented defaults, logged) gives
the prior acceptance by position per temperature, the backup's acceptance, SSD's hit rate under the plan
(``policy.predict_fixed``), and the pass-cost tables the chooser starts from and keeps fresh. For SSD,
``ssd_schedule`` also adds the cache trees the schedule chooses among to the plan (``trees.tree_options``),
before the speculator is given it.
"""
from __future__ import annotations

from dataclasses import replace

from saguaro.adapt.costs import LiveCosts
from saguaro.adapt.schedule import AdaptiveK, Priors, SSDModel
from saguaro.adapt.tree_choice import TreeModel
from saguaro.adapt.trees import tree_options
from saguaro.engine.k_schedule import FixedK, KSchedule
from saguaro.calibration.policy import entry_at, predict_fixed
from saguaro.calibration.profile import Profile
from saguaro.calibration.resolve import pair_profile
from saguaro.calibration.timeline import build_time, slowdowns
from saguaro.config import Config
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd_settings import DraftedBy, MissStrategy


def k_schedule(cfg: Config, plan: SpecPlan | None = None) -> KSchedule:
    """``FixedK`` at the configured K when ``cfg.adaptive`` is off, else ``AdaptiveK`` (SSD: over ``plan``, its
    own tree only: ``ssd_schedule`` adds the others)."""
    if not cfg.adaptive:
        return FixedK(int(cfg.num_speculative_tokens))
    return _adaptive(cfg, _profile(cfg), plan)


def ssd_schedule(cfg: Config, plan: SpecPlan) -> tuple[SpecPlan, KSchedule]:
    """SSD's plan and schedule: with adaptation, the plan gains the trees of ``trees.tree_options`` (fixed here,
    at start-up; with a calibrated profile, or ``trees_without_profile``) and the schedule picks one of them per
    round; without, both are as given."""
    if not cfg.adaptive:
        return plan, FixedK(int(cfg.num_speculative_tokens))
    profile = _profile(cfg)
    if not profile.default or cfg.adapt.trees_without_profile:  # the trees are scored by the profile's hit curves
        plan = replace(plan, options=plan.options + tree_options(plan, profile, cfg.adapt))
    return plan, _adaptive(cfg, profile, plan)


def _profile(cfg: Config) -> Profile:
    return pair_profile(cfg, int(cfg.num_speculative_tokens), "ngram")


def _adaptive(cfg: Config, profile: Profile, plan: SpecPlan | None) -> AdaptiveK:
    k = int(cfg.num_speculative_tokens)
    costs = LiveCosts.from_timing(profile.timing)
    ngram = cfg.mode == "sd" and cfg.proposer == "ngram"
    if ngram:  # the matcher drafts on the host in no time worth modelling; its acceptance is the backup's
        costs.draft = {"1": float(profile.timing.ngram_s) / max(k, 1)}
    priors = _priors(profile, k, plan, ngram)
    ssd = None
    if plan is not None:
        t0 = priors.temperatures[0]
        branches = max(sum(plan.fan_out(t0, DraftedBy.PRIMARY)), 1)
        build = build_time(profile.timing, k, 1, branches, plan.steps_for(t0), plan.deep_branches)
        sources = [entry_at(profile, t).primary for t in priors.temperatures]
        trees = TreeModel(plan, profile.timing, sources) if all(s.hit_curves for s in sources) else None
        pass_s = build.t_hit * build.t_v / (build.deep_steps + 1)  # the hit round over the passes it holds
        ssd = SSDModel(lambda b: plan.miss_strategy_for(b) == MissStrategy.JIT, pass_s,
                       slowdowns(profile.timing, branches)[0], trees,
                       builds_time_drafts=(cfg.draft_device or cfg.device) == "cpu",
                       part_slowdown=slowdowns(profile.timing, 1)[0])
    return AdaptiveK(k, cfg.adapt, costs, priors, ssd)


def _priors(profile: Profile, k: int, plan: SpecPlan | None, ngram: bool) -> Priors:
    temperatures = sorted(float(t) for t in profile.temperatures)
    acceptance, backup, p_hit = [], [], []
    # the hit rate is predicted as for a point-mass backup when misses draw random tokens (which are rarely
    # accepted: no acceptance is assumed for them); a skipped miss drafts nothing: its round is an AR step's
    strategy = plan.miss_strategy_for(1) if plan is not None else None
    random, skip = strategy == MissStrategy.RANDOM, strategy == MissStrategy.SKIP
    for t in temperatures:
        entry = entry_at(profile, t)
        source = entry.backup if ngram else entry.primary
        acceptance.append(list(source.acceptance_by_position) or [float(source.acceptance)])
        backup.append(0.0 if random or skip else float(entry.backup.acceptance))
        if plan is None:
            p_hit.append(0.0)
            continue
        predicted = predict_fixed(profile, t, k, 1, plan.fan_out(t, DraftedBy.PRIMARY),
                                  plan.fan_out(t, DraftedBy.BACKUP),
                                  MissStrategy.NGRAM if random else strategy,
                                  branch_steps=plan.steps_for(t), deep=plan.deep_branches)
        p_hit.append(min(max(float(predicted.p_hit), 0.0), 1.0))
    return Priors(temperatures, acceptance, backup, p_hit)
