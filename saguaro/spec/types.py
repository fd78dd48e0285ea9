"""What a speculator hands the verifier."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from saguaro.engine.sequence import Sequence


@dataclass
class Proposal:
    """Drafted tokens for a batch, and the distributions they were drawn from.

    ``tokens[b]`` holds up to K tokens for sequence ``b``. ``probs[b, i]`` is the exact
    distribution token ``i`` was sampled from (after temperature, top-k/top-p and any
    Saguaro down-weighting), which verification must use to stay lossless. Rows whose
    proposer is deterministic (n-gram) have ``point_mass[b] = True`` and no distribution.
    """
    tokens: list[list[int]]
    probs: torch.Tensor | None  # [B, K, V] float32, or None when every row is a point mass
    point_mass: torch.Tensor  # [B] bool
    # ranked[b][i]: the draft's most likely ids at the position of token i (only when the proposer was
    # asked to keep them: the SSD speculator reuses them as the next round's outcome guesses)
    ranked: list[list[Ranked]] | None = None

    @staticmethod
    def deterministic(tokens: list[list[int]]) -> "Proposal":
        return Proposal(tokens, None, torch.ones(len(tokens), dtype=torch.bool))


@dataclass
class Ranked:
    """The draft's most likely token ids at one position, most likely first, with their softmax
    probabilities (at temperature 1: a confidence, used only to order outcome guesses)."""
    ids: list[int]
    probs: list[float]

    def prob(self, token: int) -> float:
        """The probability of ``token``, 0 when it is not among the ranked ids."""
        return self.probs[self.ids.index(token)] if token in self.ids else 0.0


@dataclass
class RankTable:
    """The ranked ids of many rows, as two tensors. ``Ranked`` objects are made only for the rows read:
    an SSD build ranks every position of every branch, and the next round reads only the branch that hit."""
    ids: torch.Tensor  # [N, W] long, most likely first
    probs: torch.Tensor  # [N, W] float

    def rows(self, index: list[int] | None = None) -> list[Ranked]:
        """``Ranked`` for the rows in ``index`` (every row when None)."""
        ids, probs = (self.ids, self.probs) if index is None else (self.ids[index], self.probs[index])
        return [Ranked(i, p) for i, p in zip(ids.tolist(), probs.tolist())]

    @staticmethod
    def cat(tables: list["RankTable"]) -> "RankTable":
        return RankTable(torch.cat([t.ids for t in tables]), torch.cat([t.probs for t in tables]))


def rank_table(logits: torch.Tensor, width: int) -> RankTable:
    """Per row of ``logits`` [N, V], the ``width`` most likely token ids and their probabilities."""
    logits = logits.float()
    top = torch.topk(logits, min(width, logits.shape[-1]), dim=-1)
    return RankTable(top.indices, (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp())


def rank_positions(logits: torch.Tensor, width: int) -> list[Ranked]:
    """``rank_table`` as one ``Ranked`` per row."""
    return rank_table(logits, width).rows()


class Proposer(ABC):
    """Proposes draft tokens synchronously (SD) and tracks per-sequence draft state."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        """Draft ``num_tokens[b]`` tokens after all of ``seqs[b]``'s tokens."""

    def prefill(self, seqs: list[Sequence]) -> None:
        """The engine is prefilling these sequences in the target: catch up on their tokens now, so the
        draft's prompt prefill counts in the prefill (time to first token) and not in the first round."""

    def commit(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The verifier kept ``num_accepted`` drafts and appended a bonus token."""

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence."""
