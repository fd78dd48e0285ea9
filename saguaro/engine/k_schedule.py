"""Each request's K for the coming round, as the SD and SSD decoders ask for it: the seam between a decoder's
round logic and whoever chooses K (``FixedK`` here; the adaptive chooser is ``saguaro.adapt.schedule.AdaptiveK``).

``choose`` runs before a round's drafting (SD) or before the speculator answers (SSD), ``observe`` after the
round's verification. The choice for round t therefore reads only outcomes of rounds before t -- never round
t's own drafts judged by the target -- and K only says how many drafts are verified, so every K is exact.
K = 0 is an AR step for that request. In SSD ``choose`` also leaves ``tree``: which of the plan's cache trees
(fan-outs and taper) the speculator builds in this round, for the whole batch; it changes what the speculator
prepares, never what a round verifies.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from saguaro.engine.sequence import Sequence


class KSchedule(ABC):
    """K per sequence per round; records each choice in the sequence's counters (``seq.spec``)."""

    def __init__(self, max_k: int):
        if max_k < 0:
            raise ValueError(f"max K must be >= 0, got {max_k}")
        self.max_k = max_k
        self.tree = 0  # SSD: the plan's cache tree the round's build uses (``SpecPlan.trees``; 0 its own)

    def choose(self, seqs: list[Sequence]) -> list[int]:
        ks = self._choose(seqs)
        for seq, k in zip(seqs, ks):
            seq.spec.chose(k)
        return ks

    @abstractmethod
    def _choose(self, seqs: list[Sequence]) -> list[int]:
        """K for each sequence's next round, from its rounds verified so far."""

    def ahead(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """SSD: the K each sequence's round after the coming one is expected to ask, which the speculator's build
        beside the coming round prepares for (``ks``, the coming round's, stands for it unless a chooser knows
        better). It changes what is prepared, never what is verified."""
        return ks

    def catch_up(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """SSD: the ids of the sequences at K = 0 whose draft caches the speculator should bring up to date in its
        idle time beside the coming round, ahead of a speculation (none unless a chooser knows one is coming)."""
        return []

    def observe(self, seq: Sequence, drafted: int, kept: int, hit: bool | None = None) -> None:
        """``seq``'s round was verified: ``drafted`` drafts, ``kept`` accepted (and, in SSD, whether it was a
        cache hit; None where it asked no drafts: a round at K = 0)."""

    def observe_verify(self, rows: int, seconds: float, beside_build: bool = False) -> None:
        """A verification over ``rows`` target rows took ``seconds`` (SSD: ``beside_build`` while the speculator
        built its cache)."""

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        """Drafting took ``seconds`` for ``steps`` passes, the widest over ``rows`` rows."""

    def observe_answer(self, batch: int, seconds: float, depth: int | None = None) -> None:
        """SSD: after a verification of ``batch`` sequences, the speculator's answer to a round that asked for
        speculation (not every K 0) took ``seconds`` to arrive; ``depth``: the steps of the build beside that
        verification (the most K the round verified)."""

    def observe_build(self, seconds: float, steps: int) -> None:
        """The SSD speculator's last cache build took ``seconds`` for ``steps`` branch steps after its glue."""

    def observe_round(self, ks: list[int], seconds: float, beside_parts: bool = False) -> None:
        """SSD: a round that verified its requests at ``ks`` took ``seconds``, from its verification to holding the
        next speculation; ``beside_parts``: its verification ran beside a build or a catch-up of draft caches."""

    def release(self, seq_id: int) -> None:
        """Forget a finished or preempted sequence."""


class FixedK(KSchedule):
    """Every request speculates ``max_k`` tokens every round (adaptation off)."""

    def _choose(self, seqs: list[Sequence]) -> list[int]:
        return [self.max_k] * len(seqs)
