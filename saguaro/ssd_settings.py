"""SSD's settings as the user gives them, typed and validated once (``Config.ssd``).

Glossary:
  * miss strategy (``MissStrategy``): how the speculator answers a sequence whose verification outcome its
    cache missed: "jit" (the primary draft drafts it just in time), "ngram" or "random" (a point-mass
    backup drafted on the host), "skip" (no drafts: the request takes an AR step, and its next speculation is
    built beside it, as a start's is), or "auto", the default (from the pair's calibration: jit below the
    critical batch size b*, n-gram from there, Thm 18; jit without a calibration and for a GPU draft's graph
    builds: ``calibration.resolve.ssd_plan``).
  * drafted by (``DraftedBy``): who drafted a speculation, which picks the fan-outs of the cache built for
    its outcomes: the primary draft (F^p) or the backup (F^b).

Each setting is a value or "auto": read from the pair's calibration profile when the engine is built
(``saguaro.calibration.resolve``). What needs K is checked once K is known (``check_k``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Literal

Auto = Literal["auto"]


class MissStrategy(StrEnum):
    JIT = "jit"
    NGRAM = "ngram"
    RANDOM = "random"
    SKIP = "skip"  # an empty row: nothing drafted while the batch waits, nothing verified in vain
    AUTO = "auto"  # only as a setting: a plan resolves it per batch size (SpecPlan.miss_strategy_for)

    @classmethod
    def parse(cls, name: str) -> MissStrategy:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"miss_strategy must be one of {[m.value for m in cls]}, got {name!r}") from None


class DraftedBy(StrEnum):
    PRIMARY = "p"  # the draft model: a hit's branch or a just-in-time draft
    BACKUP = "b"  # the n-gram or random backup


@dataclass(frozen=True)
class SSDSettings:
    fan_out: tuple[int, ...] | Auto | None = None  # F_0..F_K of every cache; None: all 1s
    # by batch size from the pair's calibration (Thm 18; jit without one): on a 2-core Xeon with the int4 pair,
    # jit misses held the batch 60-100 ms each, and n-gram misses ran 1.1x jit's tok/s at batch 1 and 8
    miss_strategy: MissStrategy = MissStrategy.AUTO
    saguaro_c: float | Auto = 1.0  # Saguaro sampling's down-weighting constant C in [0, 1] (Def. 14)
    branch_steps: int | Auto | None = None  # build steps that decode every branch (None: K; fewer: tapered)
    deep_branches: int = 1  # the likeliest branches that go on past branch_steps, up to K tokens

    def __post_init__(self) -> None:
        fan_out = self.fan_out
        if isinstance(fan_out, (list, tuple)):
            if any(not isinstance(f, int) or f < 0 for f in fan_out):
                raise ValueError(f"fan_out entries must be ints >= 0, got {list(fan_out)}")
            object.__setattr__(self, "fan_out", tuple(fan_out))
        elif fan_out not in (None, "auto"):
            raise ValueError(f"fan_out must be a list of K+1 ints, 'auto' or None, got {fan_out!r}")
        object.__setattr__(self, "miss_strategy", MissStrategy.parse(self.miss_strategy))
        c = self.saguaro_c
        if c != "auto" and not (isinstance(c, (int, float)) and 0.0 <= c <= 1.0):
            raise ValueError(f"saguaro_c must be in [0, 1], got {c}")
        steps = self.branch_steps
        if steps not in (None, "auto") and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"branch_steps must lie in [1, K], got {steps}")
        if self.deep_branches < 1:
            raise ValueError(f"deep_branches must be >= 1, got {self.deep_branches}")

    def check_k(self, k: int) -> None:
        """What needs K: F_0..F_K has K+1 entries, and branch_steps lies in [1, K]."""
        if isinstance(self.fan_out, tuple) and len(self.fan_out) != k + 1:
            raise ValueError(f"fan_out needs K+1 = {k + 1} entries, got {len(self.fan_out)}")
        if isinstance(self.branch_steps, int) and self.branch_steps > k:
            raise ValueError(f"branch_steps must lie in [1, K = {k}], got {self.branch_steps}")

    def check_vocab(self, vocab: int) -> None:
        if isinstance(self.fan_out, tuple) and max(self.fan_out) > vocab:
            raise ValueError(f"fan_out entries must not exceed the vocabulary size ({vocab})")

    @property
    def any_auto(self) -> bool:
        """Whether some setting is read from the calibration profile."""
        return any(getattr(self, f.name) == "auto" for f in fields(self))

    def fan_out_for(self, k: int) -> list[int]:
        """The explicit F_0..F_K (all 1s for None)."""
        return list(self.fan_out) if isinstance(self.fan_out, tuple) else [1] * (k + 1)


SETTINGS = tuple(f.name for f in fields(SSDSettings))  # the flat Config / LLM keyword arguments that fill it
