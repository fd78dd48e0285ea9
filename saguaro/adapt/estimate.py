"""A request's running acceptance, by draft position, from its last rounds and a prior.

Position j's rate a_j = P(draft j accepted | drafts 1..j-1 were) (Thm 1, per position). A round that drafted
k tokens and kept m tried positions 1..min(m + 1, k): the first m accepted, position m + 1 rejected (if
drafted). Every round decays all positions' counts of trials and acceptances (the estimate is of the last
rounds: evidence at a position no longer reached fades); the prior enters as ``prior_rounds`` pseudo-trials at
the profile's rate, decayed with each trial of its position down to ``PRIOR_FLOOR`` of them, so a new request
starts from the profile and its own rounds take over within a few rounds. A position this request has
seldom reached takes the profile's rate scaled by what its first position shows (the ratio of its estimate to
its prior there): a request whose first drafts fail is not assumed to accept deep ones at the profile's rate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_FLOOR = 0.05  # share of prior_rounds the prior keeps however long a position is observed


@dataclass
class AcceptanceEstimate:
    prior: list[float]  # a_j before any round, j = 1..len(prior); positions past it reuse the last
    prior_rounds: float = 2.0
    decay: float = 0.8
    tried: list[float] = field(default_factory=list)  # decayed trials per position
    prior_weight: list[float] = field(default_factory=list)  # the prior's decayed pseudo-trials per position
    accepted: list[float] = field(default_factory=list)  # decayed acceptances per position
    rounds: int = 0
    known: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)  # rates(k) this round

    def __post_init__(self) -> None:
        if not self.prior or any(not 0.0 <= p <= 1.0 for p in self.prior):
            raise ValueError(f"a prior acceptance needs rates in [0, 1], got {self.prior}")

    def observe(self, drafted: int, kept: int) -> None:
        """A verified round: ``drafted`` tokens proposed, the first ``kept`` accepted."""
        if not 0 <= kept <= drafted:
            raise ValueError(f"kept {kept} of {drafted} drafts")
        if drafted == 0:
            return
        self.rounds += 1
        self.known.clear()
        grow = drafted - len(self.tried)
        if grow > 0:
            self.tried += [0.0] * grow
            self.accepted += [0.0] * grow
            self.prior_weight += [self.prior_rounds] * grow
        self.tried = [self.decay * n for n in self.tried]
        self.accepted = [self.decay * a for a in self.accepted]
        floor = PRIOR_FLOOR * self.prior_rounds
        for j in range(min(kept + 1, drafted)):
            self.prior_weight[j] = max(floor, self.decay * self.prior_weight[j])
            self.tried[j] += 1.0
            self.accepted[j] += float(j < kept)

    def tried_at(self, j: int) -> float:
        """The decayed trials of draft position j (0-based): how much of its rate is this request's own."""
        return self.tried[j] if j < len(self.tried) else 0.0

    def rate(self, j: int) -> float:
        """a_{j+1}: the estimated acceptance of draft position j (0-based)."""
        return self.rates(j + 1)[j]

    def rates(self, k: int) -> list[float]:
        """[a_1, ..., a_k] (plain Python: the chooser asks for every request every round, K is small; kept until
        the next observed round, as a request's estimate is read again by ``observe`` and the next choice)."""
        known = self.known.get(k)
        if known is None:
            known = self.known[k] = self._rates(k)
        return list(known)

    def _rates(self, k: int) -> list[float]:
        first = self.prior[0]
        scale = self._posterior(0, first) / first if first > 0 else 1.0  # the first position's estimate / prior
        last, seen = len(self.prior) - 1, len(self.tried)
        out = []
        for j in range(k):
            prior = self.prior[min(j, last)]
            if j and first > 0:
                prior = min(1.0, prior * scale)
            out.append(self._posterior(j, prior) if j < seen else prior)
        return out

    def _posterior(self, j: int, prior: float) -> float:
        if j >= len(self.tried):
            return prior
        w = self.prior_weight[j]
        return (self.accepted[j] + w * prior) / (self.tried[j] + w)

    def outcome_pmf(self, k: int) -> list[float]:
        """[P(0), ..., P(k)]: the law of a K-draft round's outcome, d drafts accepted then one rejected (d < K),
        or all K accepted (index K), from the rates by position."""
        out, run = [], 1.0
        for a in self.rates(k):
            out.append(run * (1.0 - a))
            run *= a
        return out + [run]

    def expected_tokens(self, k: int) -> list[float]:
        """[E(0), ..., E(k)]: expected tokens a round of K drafts yields, E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j
        (positional form of ``theory.speedup.expected_tokens``, which it equals when every a_j is the same)."""
        out, run, total = [1.0], 1.0, 1.0
        for a in self.rates(k):
            run *= a
            total += run
            out.append(total)
        return out
