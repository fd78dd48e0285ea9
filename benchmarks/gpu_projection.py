"""What the real Qwen pair would do on a GPU: its measured acceptance and hit curves on GPU pass costs.

These are **projections**, not measurements. The acceptance and cache-hit curves come from a calibration
profile of the real Qwen2.5-Coder 1.5B / 0.5B pair on HumanEval, measured on the CPU (``saguaro calibrate
--workload code``; the stored JSON is ``results/profile_qwen2.5-coder_code.json``). The costs come from a
GPU run of ``bench gpu``: the target's forward over 1..8 rows and the draft's over 1..64 rows, on random
weights of the named shapes. The policy's own model (``saguaro/calibration/policy.py``: Thm 2 / Cor. 17
with the build and the verification on one timeline) turns them into tokens per second for AR, SD at its
best K and SSD at its best K, fan-out and tree taper. It assumes the verification is not slowed by the
build beside it (the colocated speculator shares the GPU: ``bench gpu --mode ssd`` measures that slowdown).

The same profile is used for every shape pair: the Llama and 32B pairs' real acceptance differs, so their
rows show what the Qwen pair's acceptance would give at those costs.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from saguaro.calibration.policy import best_choice, entry_at, sd_tokens_per_s, tree_shapes
from saguaro.calibration.profile import Profile, Timing
from saguaro.calibration.timeline import rows_time

PROFILE_PATH = Path("results/profile_qwen2.5-coder_code.json")
NGRAM_S = 2e-4  # an n-gram proposal on the host: the backup's cost, beside GPU passes of milliseconds


def gpu_timing(target_ms: dict[str, float], draft_ms: dict[str, float], k: int) -> Timing:
    """A ``Timing`` from ``bench gpu``'s pass costs: ``rows_N`` entries of the target (decode, verification)
    and of the draft (steps and tree steps), in milliseconds."""
    def table(costs: dict[str, float]) -> dict[str, float]:
        rows = {}
        for key, ms in costs.items():
            kind, _, n = key.partition("_")
            if kind in ("rows", "tree") and n.isdigit():
                rows[n] = min(rows.get(n, float("inf")), ms / 1e3)
        return rows
    target, draft = table(target_ms), table(draft_ms)
    verify = rows_time(target, k + 1)
    step = rows_time(draft, 1)
    return Timing(target_rows=target, draft_rows=draft, ngram_s=NGRAM_S, verify_s=verify, draft_step_s=step,
                  T_p=k * step / verify, T_b=NGRAM_S / verify)


def project(profile: Profile, target_ms: dict[str, float], draft_ms: dict[str, float], ks=range(2, 7),
            temperature: float = 0.0, vocab: int = 151936) -> dict[str, Any]:
    """AR, SD (best K) and SSD (best K, budget and taper, just-in-time fallback) tokens per second at batch 1."""
    entry = entry_at(profile, temperature)
    ar = 1.0 / rows_time(gpu_timing(target_ms, draft_ms, 1).target_rows, 1)
    sd = max(((k, sd_tokens_per_s(dataclasses.replace(profile, timing=gpu_timing(target_ms, draft_ms, k)), entry, k))
              for k in ks), key=lambda x: x[1])
    best = None
    for k in ks:
        p = dataclasses.replace(profile, timing=gpu_timing(target_ms, draft_ms, k))
        choice = best_choice(p, entry, k, 1, "jit", vocab, tree_shapes(k, True))
        if best is None or choice.tok_s > best[1].tok_s:
            best = (k, choice)
    k, choice = best
    return {"temperature": temperature, "ar_tok_s": ar, "sd_k": sd[0], "sd_tok_s": sd[1], "ssd_k": k,
            "ssd_tok_s": choice.tok_s, "ssd_fan_out": choice.primary, "ssd_branch_steps": choice.branch_steps,
            "ssd_p_hit": choice.p_hit, "ssd_x_sd": choice.tok_s / sd[1], "ssd_x_ar": choice.tok_s / ar,
            "acceptance": entry.primary.acceptance}


def load_profile(path: Path = PROFILE_PATH) -> Profile | None:
    """The committed CPU profile of the real pair, or None when it is not there."""
    if not path.exists():
        return None
    return Profile.from_dict(json.loads(path.read_text()))
