"""The engine's "auto" settings, resolved from the pair's calibration profile when the engine is built.

``Config`` only validates: K = "auto", and the SSD settings (``Config.ssd``) ``fan_out``, ``saguaro_c``,
``miss_strategy`` and ``branch_steps`` = "auto", stay as they are there. ``LLM`` resolves them here:
``resolve_k`` before it loads the models, ``ssd_plan`` when it builds the SSD decoder (it needs the target's
vocabulary).
Without a stored profile both use the documented defaults (``profile.default_profile``), with a warning.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from saguaro.calibration import pair_cost
from saguaro.calibration.policy import make_plan, recommended_k
from saguaro.calibration.profile import Profile
from saguaro.calibration.store import resolve_profile
from saguaro.config import Config
from saguaro.placement import gpu_index
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd_settings import MissStrategy

log = logging.getLogger("saguaro.ssd")


def _timed_eager(cfg: Config) -> bool:
    """Whether the engine runs the eager reference rather than the bf16 kernels the ``__fast`` profiles were
    timed on: the fast path applies to bf16 models only (an fp32 engine runs eager whatever ``enforce_eager``
    says)."""
    return cfg.enforce_eager or cfg.torch_dtype != torch.bfloat16


def pair_profile(cfg: Config, k: int, no_draft: str | None = None) -> Profile:
    """``cfg``'s pair's calibration profile, or the documented defaults with what is known of the pair's passes
    (``pair_cost``); ``no_draft`` names the draft where ``cfg.draft`` is None (the n-gram matcher)."""
    profile = resolve_profile(cfg.target, cfg.draft or no_draft, cfg.dtype, k, enforce_eager=_timed_eager(cfg),
                              draft_format=cfg.draft_format.tag, workload=cfg.calibration_workload,
                              costs=lambda: pair_cost.pair_costs(cfg), target_weights=cfg.target_weights)
    return on_these_kernels(profile, cfg)


def on_these_kernels(profile: Profile, cfg: Config) -> Profile:
    """``profile``, its row tables reshaped to the CPU kernel tier the engine runs where it was timed on another
    (``pair_cost.reshaped``). The tiers' row curves differ most: on one Zen 4 core an int4 target verifies 3
    rows at 1.3x a decode step with the avx512 kernels and at 2.2x with the avx2 ones, so an engine forced to
    avx2 priced by an avx512 profile speculated on chat at 0.8x AR. A profile that does not say its tier was
    calibrated before tiers were recorded, on this machine's default: the best tier it executes."""
    if profile.default or profile.enforce_eager or _timed_eager(cfg) or cfg.device != "cpu":
        return profile
    from saguaro.backends.cpu_kernels import build
    running = build.running_tier()
    timed_on = profile.kernels or build.best_tier()
    costs = pair_cost.pair_costs(cfg) if running is not None and timed_on != running else None
    if costs is None or costs.target_rows is None:
        return profile
    _warn_other_tier(str(cfg.target), str(cfg.draft), timed_on, running)
    return dataclasses.replace(profile, timing=pair_cost.reshaped(profile.timing, costs, profile.k), kernels=running)


@functools.cache  # once per pair and tiers: an engine resolves its profile for K, the plan and the chooser
def _warn_other_tier(target: str, draft: str, timed_on: str, running: str) -> None:
    log.warning("calibration profile for %s / %s timed on the %s kernels, the engine runs the %s ones: its row "
                "tables take this tier's row curves (run `saguaro calibrate` on this tier for its own)",
                target, draft, timed_on, running)


def resolve_k(cfg: Config) -> Config:
    """``cfg`` with K = "auto" replaced by the K with the best predicted speedup for this pair (validated
    again, now against K); ``cfg`` itself when K is given."""
    if cfg.num_speculative_tokens != "auto":
        return cfg
    ssd = cfg.ssd
    profile = pair_profile(cfg, 4)
    k = recommended_k(profile, ssd.miss_strategy, mode=cfg.mode, taper=ssd.branch_steps == "auto",
                      deep=ssd.deep_branches)
    return dataclasses.replace(cfg, num_speculative_tokens=k)


def _graph_builds(cfg: Config) -> bool:
    """Whether the speculator's builds run as graph replays (a GPU draft on the paged backend)."""
    return gpu_index(cfg.draft_device or cfg.device) is not None and not cfg.enforce_eager


def ssd_plan(cfg: Config, vocab: int) -> SpecPlan:
    """Fan-outs, Saguaro C and miss strategy for the speculator (K already resolved).

    Explicit settings (``cfg.ssd``: a ``fan_out`` list or None for uniform 1s, a numeric ``saguaro_c``, a
    named ``miss_strategy``, a ``branch_steps`` count or None) give a fixed plan. Any "auto" loads the
    calibration profile for (target, draft, dtype) -- or the documented defaults, with a warning -- and lets
    ``saguaro.calibration.policy.make_plan`` choose (Thm 12 / Thm 13 fan-outs per temperature, batch size and
    drafter; C; Thm 18's b*; the tree's taper); explicit settings still override their part of it. The miss
    strategy "auto" (the default) is jit at every batch size without a calibration, and where builds run as graph
    replays (``_graph_builds``).
    """
    settings, k = cfg.ssd, cfg.num_speculative_tokens
    settings.check_vocab(vocab)
    profile = pair_profile(cfg, k) if settings.any_auto else None
    if settings.miss_strategy == MissStrategy.AUTO and (profile.default or _graph_builds(cfg)):
        # the defaults' hit model (1 - F^-r) predicts no hit for a single guess, so Thm 18 would send every miss
        # of the default tree to the backup and the chooser to K = 0; and a graph build replays after a full-K
        # speculation of the draft: a backup's (shorter, or not in the draft cache) sends it back to the Python
        # build, the host work the graph removes
        settings = dataclasses.replace(settings, miss_strategy=MissStrategy.JIT)
    if settings.any_auto:
        chosen = make_plan(profile, k, settings, cfg.max_num_seqs, vocab)
        log.info("SSD plan (%s): %s", "defaults" if profile.default else "calibrated", chosen.summary)
        return chosen.plan
    return SpecPlan.fixed(settings.fan_out_for(k), float(settings.saguaro_c), settings.miss_strategy,
                          branch_steps=settings.branch_steps, deep_branches=settings.deep_branches)
