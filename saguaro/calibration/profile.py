"""The calibration profile of a target/draft pair: what it holds, and the defaults.

Stored as JSON by ``store.py``. Schema (version 1)::

    {"version": 1, "target", "draft", "draft_format", "dtype", "fast", "k": K used to calibrate, "created",
     "settings": {...},
     "timing": {                       # seconds, one process on one core, min over repeats
        "target_rows": {"n": s},       # one target forward over n new rows (n = K+1 is a verification)
        "draft_rows": {"n": s},        # one draft forward over n new rows (a branch step of n rows, a glue)
        "ngram_s": s,                  # one n-gram proposal of K tokens
        "verify_s", "draft_step_s",    # target over K+1 rows; draft over 1 row
        "T_p": K draft steps / verify (SD's T_SD), "T_b": n-gram / verify},
     "temperatures": {"<T>": {
        "primary": SOURCE, "backup": SOURCE,   # rounds after a primary (draft) / backup (n-gram) speculation
        "c_sweep": [{"c", "acceptance", "tokens_per_round", "hit_curves", ...}],   # Saguaro C < 1, optional
     }}}

    SOURCE = {"rounds", "ranked_rounds",
              "acceptance": a_p or a_b, P(a drafted token is accepted | all earlier ones were), the MLE
                  accepted / (accepted + rejections) of Thm 2's capped-geometric model,
              "accepted_per_drafted" (the engine's acceptance_rate), "acceptance_by_position",
              "tokens_per_round": accepted + bonus per round (E_hit / E_miss as measured),
              "outcome_pmf": P(k accepted), k = 0..K, over full-length speculations,
              "depth_pmf": P(the outcome lands at cache depth d), d = 0..K (K: everything accepted), all rounds,
              "hit_curves": K+1 lists, [k][F] = p_hit^k(F) for F = 0..F_MAX (row K: all accepted, Thm 13),
              "miss_uniform": [F] = miss rate with the same F at every depth (paper fig. 3),
              "r": power-law exponent (Def. 11, theory.fit_power_law), "r2": fit quality on log-log axes,
              "power_law": r2 >= POWER_LAW_R2}

Defaults (no profile; the engine logs that it used them), chosen from shared/MODELS.md's CPU numbers and the
paper's fits: primary a_p = 0.75 with r_p = 0.6, backup a_b = 0.3 with r_b = 0.4 at every temperature; a
draft row costs 0.38 of a target row, a draft step over n rows costs 0.38 (1 + 0.035 (n - 1)) and a
verification over n rows 1 + 0.02 (n - 1) target rows; n-gram time 0.
"""
from __future__ import annotations

import time

import numpy as np

from saguaro.config import DTYPES

PROFILE_VERSION = 1
F_MAX = 64  # hit curves are stored for fan-outs 0..F_MAX
POWER_LAW_R2 = 0.9  # the power law "fits" when R^2 on log-log axes reaches this
DEFAULTS = {"a_p": 0.75, "r_p": 0.6, "a_b": 0.3, "r_b": 0.4, "draft_ratio": 0.38, "draft_slope": 0.035,
            "target_slope": 0.02}
ROW_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def dtype_name(dtype) -> str:
    return str(DTYPES.get(dtype, dtype)).replace("torch.", "")


def power_law_source(a: float, r: float, k: int) -> dict:
    """A SOURCE entry whose hit curves follow 1 - F^{-r} at every depth (Def. 11), acceptance a."""
    f = np.arange(F_MAX + 1, dtype=float)
    hit = np.where(f > 0, 1.0 - np.maximum(f, 1.0) ** (-r), 0.0)
    pmf = [a ** j * (1 - a) for j in range(k)] + [a ** k]
    return {"rounds": 0, "ranked_rounds": 0, "acceptance": a, "accepted_per_drafted": None,
            "acceptance_by_position": [a] * k, "tokens_per_round": float(sum(a ** j for j in range(k + 1))),
            "outcome_pmf": pmf, "depth_pmf": pmf,
            "hit_curves": [hit.tolist()] * (k + 1), "miss_uniform": (1.0 - hit).tolist(), "r": r, "r2": 1.0,
            "power_law": True}


def model_timing(k: int, verify_s: float = 1.0) -> dict:
    """The default timing table (relative units, a verification = ``verify_s``)."""
    d = DEFAULTS
    step = verify_s * d["draft_ratio"]
    target = {str(n): verify_s * (1 + d["target_slope"] * (n - 1)) / (1 + d["target_slope"] * k) for n in ROW_GRID}
    draft = {str(n): step * (1 + d["draft_slope"] * (n - 1)) for n in ROW_GRID}
    return {"target_rows": target, "draft_rows": draft, "ngram_s": 0.0, "verify_s": verify_s,
            "draft_step_s": step, "T_p": k * step / verify_s, "T_b": 0.0}


def default_profile(target: str, draft: str, dtype, k: int = 4) -> dict:
    """The documented defaults in the profile schema (``"default": True``), for greedy and temperature 1."""
    d = DEFAULTS
    entry = {"primary": power_law_source(d["a_p"], d["r_p"], k), "backup": power_law_source(d["a_b"], d["r_b"], k),
             "c_sweep": []}
    return {"version": PROFILE_VERSION, "default": True, "target": str(target), "draft": str(draft),
            "dtype": dtype_name(dtype), "k": k, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "settings": {},
            "timing": model_timing(k), "temperatures": {"0.0": entry, "1.0": entry}}
