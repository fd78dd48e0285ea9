"""The engine's "auto" settings, resolved from the pair's calibration profile when the engine is built.

``Config`` only validates: K = "auto", and the SSD settings ``fan_out``, ``saguaro_c``, ``fallback`` and
``branch_steps`` = "auto", stay as they are there. ``LLM`` resolves them here: ``resolve_k`` before it
loads the models, ``ssd_plan`` when it builds the SSD decoder (it needs the target's vocabulary).
Without a stored profile both use the documented defaults (``profile.default_profile``), with a warning.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from saguaro.calibration.policy import describe, make_plan, recommended_k
from saguaro.calibration.store import resolve_profile
from saguaro.config import Config
from saguaro.ssd.plan import SpecPlan

log = logging.getLogger("saguaro.ssd")


def _timed_fast(cfg: Config) -> bool:
    """Whether the engine runs the bf16 kernels the ``__fast`` profiles were timed on: the fast path applies to
    bf16 models only (an fp32 engine runs the eager reference whatever ``enforce_eager`` says)."""
    return cfg.fast and cfg.torch_dtype == torch.bfloat16


def resolve_k(cfg: Config) -> Config:
    """``cfg`` with K = "auto" replaced by the K with the best predicted speedup for this pair (validated
    again, now against K); ``cfg`` itself when K is given."""
    if cfg.num_speculative_tokens != "auto":
        return cfg
    profile = resolve_profile(cfg.target, cfg.draft, cfg.dtype, 4, fast=_timed_fast(cfg),
                              draft_format=cfg.draft_format.tag, workload=cfg.calibration_workload)
    k = recommended_k(profile, cfg.fallback, mode=cfg.mode, taper=cfg.branch_steps == "auto",
                      deep=cfg.deep_branches)
    return dataclasses.replace(cfg, num_speculative_tokens=k)


def ssd_plan(cfg: Config, vocab: int) -> SpecPlan:
    """Fan-outs, Saguaro C and fallback for the speculator (K already resolved).

    Explicit settings (a ``fan_out`` list or None for uniform 1s, a numeric ``saguaro_c``, a named
    ``fallback``, a ``branch_steps`` count or None) give a fixed plan. Any "auto" loads the calibration
    profile for (target, draft, dtype) -- or the documented defaults, with a warning -- and lets
    ``saguaro.calibration.policy.make_plan`` choose (Thm 12 / Thm 13 fan-outs per temperature, batch size and
    source; C; Thm 18's b*; the tree's taper); explicit settings still override their part of it.
    """
    k = cfg.num_speculative_tokens
    if isinstance(cfg.fan_out, list) and max(cfg.fan_out) > vocab:
        raise ValueError(f"fan_out entries must not exceed the vocabulary size ({vocab})")
    fixed = cfg.fan_out if isinstance(cfg.fan_out, list) else [1] * (k + 1)
    autos = [cfg.fan_out, cfg.fallback, cfg.saguaro_c, cfg.branch_steps]
    if "auto" not in autos:
        return SpecPlan.fixed(fixed, float(cfg.saguaro_c), cfg.fallback, branch_steps=cfg.branch_steps,
                              deep_branches=cfg.deep_branches)
    profile = resolve_profile(cfg.target, cfg.draft, cfg.dtype, k, fast=_timed_fast(cfg),
                              draft_format=cfg.draft_format.tag,
                              workload=cfg.calibration_workload)
    plan = make_plan(profile, k, cfg.saguaro_c, cfg.fallback, cfg.max_num_seqs, vocab, cfg.branch_steps == "auto",
                     cfg.deep_branches)
    if cfg.fan_out != "auto":
        plan.primary = [[list(fixed)] for _ in plan.temperatures]
        plan.backup = [[list(fixed)] for _ in plan.temperatures]
    if cfg.branch_steps != "auto":
        plan.branch_steps = [cfg.branch_steps] * len(plan.temperatures)
    log.info("SSD plan (%s): %s", "defaults" if profile.default else "calibrated", describe(plan))
    return plan
