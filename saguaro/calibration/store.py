"""Where calibration profiles live, and which one the engine reads.

One JSON file per profile (``Profile.to_dict``) at
``<cache_root>/profiles/<target>[@<weights>]__<draft>[@<format>]__<dtype>[__fast][~<workload>].json``
(``saguaro.loading.cache_root``; ``SAGUARO_CACHE`` moves it). ``__fast``: timed on the bf16 fast path that
``Config(enforce_eager=False)`` selects; ``@<weights>``: the target ran with ``target_weights`` int8 or int4, a
model of its own with its own costs; ``@<format>``: the draft ran as ``DraftFormat.tag``, e.g. ``int8-v65536``,
since its weights and head change both its step time and its ranks; ``~<workload>``: calibrated on code or chat
prompts only (``config.WORKLOADS``; "mixed" has no suffix).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from saguaro.calibration.profile import PairCosts, Profile, ProfileError, default_profile, dtype_name
from saguaro.config import check_workload
from saguaro.loading.paths import cache_root
from saguaro.profile_files import slug

log = logging.getLogger("saguaro.calibration")


def profile_path(target: str, draft: str, dtype, enforce_eager: bool = True, draft_format: str = "",
                 workload: str = "mixed", target_weights: str = "bf16") -> Path:
    """Keyed by target (and its weight format), draft (and its format tag) and dtype; timed on the bf16 fast path
    (``enforce_eager`` False) adds a suffix, and so does a workload other than "mixed" (``WORKLOADS``)."""
    check_workload(workload)
    suffix = ("" if enforce_eager else "__fast") + ("" if workload == "mixed" else f"~{workload}")
    fmt = f"@{slug(draft_format)}" if draft_format else ""
    weights = "" if target_weights == "bf16" else f"@{slug(target_weights)}"
    return (cache_root() / "profiles" /
            f"{slug(target)}{weights}__{slug(draft)}{fmt}__{dtype_name(dtype)}{suffix}.json")


def save_profile(profile: Profile) -> Path:
    path = profile_path(profile.target, profile.draft, profile.dtype, profile.enforce_eager, profile.draft_format,
                        profile.workload, profile.target_weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    tmp.replace(path)
    return path


def load_profile(target: str, draft: str, dtype, enforce_eager: bool = True, draft_format: str = "",
                 workload: str = "mixed", target_weights: str = "bf16") -> Profile | None:
    """The stored profile, or None if there is none. One that cannot be used -- unreadable, of another
    version or layout -- is None too, and the log says so and to re-run ``saguaro calibrate``."""
    path = profile_path(target, draft, dtype, enforce_eager, draft_format, workload, target_weights)
    try:
        return Profile.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except ProfileError as e:
        reason = str(e)
    except (TypeError, AttributeError) as e:  # a value of the wrong kind where an object or a list belongs
        reason = f"its layout does not match this engine's ({e})"
    except (OSError, ValueError) as e:  # unreadable, or not JSON
        reason = f"it cannot be read ({e})"
    log.warning("calibration profile %s cannot be used: %s; re-run `saguaro calibrate` for this pair and "
                "settings to measure it again", path, reason)
    return None


def resolve_profile(target: str, draft: str, dtype, k: int, enforce_eager: bool = True, draft_format: str = "",
                    workload: str = "mixed", costs: Callable[[], PairCosts] | None = None,
                    target_weights: str = "bf16") -> Profile:
    """The stored profile, or the documented defaults (logged).

    Preferred: the profile timed as the engine will run -- on the fast path unless ``enforce_eager`` (as Config),
    with the draft in ``draft_format`` (``DraftFormat.tag``). Failing that, the nearest one that exists
    (same format eager, then the plain draft), with a warning: its acceptance and hit curves still apply
    roughly, its timings do not. A ``workload`` ("code", "chat") without its own profile falls back to the
    "mixed" one, whose acceptance and hit rates are those of both kinds of prompts. Only a profile of the same
    ``target_weights`` is taken: an int4 target verifies at a third of a bf16 one's cost, so the other's costs
    would mislead every choice, and the defaults know the target's bytes. ``costs``: what the defaults know of the
    pair's passes (``default_profile``), asked only when no profile is stored."""
    settings = [(enforce_eager, draft_format), (True, draft_format), (enforce_eager, ""), (True, "")]
    tried = [(f, fmt, w) for w in dict.fromkeys([workload, "mixed"]) for f, fmt in settings]
    for i, (f, fmt, w) in enumerate(dict.fromkeys(tried)):
        profile = load_profile(target, draft, dtype, f, fmt, w, target_weights)
        if profile is None:
            continue
        if i:
            log.warning("no calibration profile for %s / %s as configured (enforce_eager %s, draft format "
                        "%r, workload %s); using the one with enforce_eager %s, draft format %r, workload %s, whose "
                        "timings or rates differ (run `saguaro calibrate` with the same settings)", target, draft,
                        enforce_eager,
                        draft_format or "bf16", workload, f, fmt or "bf16", w)
        return profile
    log.warning("no calibration profile for target=%s%s draft=%s dtype=%s (run `saguaro calibrate`); "
                "using the documented defaults (saguaro.calibration.profile.DEFAULTS)", target,
                "" if target_weights == "bf16" else f" ({target_weights} weights)", draft, dtype)
    return default_profile(target, draft, dtype, k, costs() if costs is not None else None)
