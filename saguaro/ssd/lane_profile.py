"""The overlap probe's verdict, kept as a profile: how to arrange one GPU between the target and its speculator.

``benchmarks/gpu_overlap.py`` measures a verification graph beside draft graphs under each arrangement -- stream
priorities off or on (``stream_priority.py``), the draft on all SMs or in a green context of some SMs -- and
``verdict`` picks the one whose pair finishes soonest together (the probe's own figure, ``together_speedup``).
The probe saves it with the figures that chose it, the card's name and torch's version, beside the calibration
profiles (``<cache_root>/profiles/lanes__<card>.json``; ``SAGUARO_CACHE`` moves it).

A speculator thread on a GPU (``thread_link.py``) reads it at start-up through ``resolve_lanes``: the settings
override it (``SAGUARO_STREAM_PRIORITIES``, ``SAGUARO_SPECULATOR_SMS``), a profile of this card and torch is used,
and anything else -- none, another card, another torch, another layout -- gives today's default (priorities on,
all SMs) with one log line saying why. On the CPU the arrangement is resolved and reported but changes nothing.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from saguaro.profile_files import ProfileError, checked_fields, slug
from saguaro.loading.paths import cache_root
from saguaro.ssd.stream_priority import OFF

log = logging.getLogger("saguaro.ssd")

LANE_PROFILE_VERSION = 1
SMS_ENV = "SAGUARO_SPECULATOR_SMS"  # a green context of this many SMs for the speculator; 0 or "all": none
PRIORITIES_ENV = "SAGUARO_STREAM_PRIORITIES"


@dataclass(frozen=True)
class Arrangement:
    """Stream priorities on or off, and the speculator's SMs (None: all of them, no green context)."""
    priorities: bool = True
    sms: int | None = None

    @property
    def name(self) -> str:
        return (f"priorities {'on' if self.priorities else 'off'}, speculator on "
                + (f"a green context of {self.sms} SMs" if self.sms else "all SMs"))


DEFAULT = Arrangement()  # the engine's arrangement before the probe: the target first, the GPU shared


@dataclass(frozen=True)
class Candidate:
    """One arrangement as the probe measured it (medians over its repeats)."""
    arrangement: Arrangement
    together_speedup: float  # one after the other / together (> 1: the overlap pays); the figure that chooses
    verify_slowdown: float | None = None  # the verification beside the draft / alone
    draft_slowdown: float | None = None
    together_spread: float | None = None  # (q3 - q1) / median of the together wall times: the figure's noise


@dataclass
class LaneProfile:
    """The probe's verdict on one card under one torch (``verdict``), with every candidate it weighed."""
    card: str  # torch.cuda.get_device_name
    torch: str  # torch.__version__
    best: Candidate
    candidates: list[Candidate]
    version: int = LANE_PROFILE_VERSION
    created: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # how the probe ran: shapes, rows, repeats

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LaneProfile:
        """Raises ``ProfileError`` for another version or layout."""
        version = data.get("version") if isinstance(data, dict) else None
        if version != LANE_PROFILE_VERSION:
            raise ProfileError(f"it is version {version}, this engine reads version {LANE_PROFILE_VERSION}")
        d = checked_fields(cls, data, "lane profile")
        d["best"] = _candidate(d["best"], "best")
        d["candidates"] = [_candidate(c, "candidates") for c in d["candidates"]]
        return cls(**d)


def _candidate(data: Any, where: str) -> Candidate:
    d = checked_fields(Candidate, data, where)
    d["arrangement"] = Arrangement(**checked_fields(Arrangement, d["arrangement"], f"{where}.arrangement"))
    return Candidate(**d)


def verdict(candidates: list[Candidate]) -> Candidate | None:
    """The candidate whose pair finishes soonest together. Those within the best's own spread of it tie, and a
    tie goes to the arrangement nearest the default: no green context before one, priorities on before off,
    then the smaller verification slowdown. None when no candidate has the figure (every one failed)."""
    done = [c for c in candidates if c.together_speedup]
    if not done:
        return None
    top = max(done, key=lambda c: c.together_speedup)
    floor = top.together_speedup * (1 - (top.together_spread or 0.0))
    tied = [c for c in done if c.together_speedup >= floor]
    return min(tied, key=lambda c: (c.arrangement.sms is not None, not c.arrangement.priorities,
                                    c.verify_slowdown if c.verify_slowdown is not None else float("inf")))


def lane_profile_path(card: str) -> Path:
    return cache_root() / "profiles" / f"lanes__{slug(card)}.json"


def save_lane_profile(profile: LaneProfile, path: Path | None = None) -> Path:
    path = path or lane_profile_path(profile.card)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.created = profile.created or time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    tmp.replace(path)
    return path


def read_lane_profile(path: Path, card: str, torch_version: str) -> tuple[LaneProfile | None, str]:
    """The profile at ``path`` if it holds for ``card`` under ``torch_version``, else None; and why, in words."""
    try:
        profile = LaneProfile.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None, f"no overlap-probe profile at {path} (run `python -m benchmarks.gpu_overlap` on this GPU)"
    except (ProfileError, TypeError, AttributeError, OSError, ValueError) as e:
        return None, f"the overlap-probe profile {path} cannot be used ({e}); run the probe again"
    if profile.card != card:
        return None, f"the overlap-probe profile {path} is of another card ({profile.card}, this is {card})"
    if profile.torch != torch_version:
        return None, (f"the overlap-probe profile {path} was measured under torch {profile.torch}, this is "
                      f"{torch_version}; run the probe again")
    return profile, (f"the overlap probe's verdict ({path}: {profile.best.together_speedup:.2f}x faster together "
                     f"on {card}, torch {torch_version})")


@dataclass(frozen=True)
class LaneChoice:
    """The arrangement a speculator thread runs with, and where it came from (``source``: "profile",
    "default", "setting" or "cpu"; ``detail``: one line saying why)."""
    priorities: bool
    sms: int | None
    source: str
    detail: str

    @property
    def arrangement(self) -> Arrangement:
        return Arrangement(self.priorities, self.sms)


def device_card(device: str | torch.device) -> str | None:
    """The CUDA card's name, None for any other device."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def resolve_lanes(device: str | torch.device, env: dict[str, str] | None = None) -> LaneChoice:
    """The arrangement for a speculator thread on ``device``: the probe's profile for this card and torch, or the
    default; either overridden field by field by the settings. Logs one line where the profile is not used."""
    env = os.environ if env is None else env
    card = device_card(device)
    if card is None:
        base, source, detail = DEFAULT, "cpu", f"{device} is not a CUDA device: no streams or green contexts"
    else:
        profile, detail = read_lane_profile(lane_profile_path(card), card, torch.__version__)
        base, source = (profile.best.arrangement, "profile") if profile else (DEFAULT, "default")
        if profile is None:
            log.info("speculator lanes: today's default (%s): %s", DEFAULT.name, detail)
    priorities, sms = base.priorities, base.sms
    overridden = []
    if env.get(PRIORITIES_ENV, "").strip():
        priorities = env[PRIORITIES_ENV].strip().lower() not in OFF
        overridden.append(f"{PRIORITIES_ENV}={env[PRIORITIES_ENV]}")
    if env.get(SMS_ENV, "").strip():
        sms = parse_sms(env[SMS_ENV])
        overridden.append(f"{SMS_ENV}={env[SMS_ENV]}")
    if overridden and source != "cpu":
        source, detail = "setting", f"{', '.join(overridden)} over {detail}"
    return LaneChoice(priorities, sms, source, detail)


def parse_sms(text: str) -> int | None:
    """``SAGUARO_SPECULATOR_SMS``: a positive count, or 0 / "all" / "none" for all SMs."""
    value = text.strip().lower()
    if value in ("0", "all", "none"):
        return None
    if not value.isdigit():
        raise ValueError(f"{SMS_ENV}={text!r}: give a number of SMs, or 0 / all for all of them")
    return int(value)
