"""A draft's ranking of next tokens: its most likely ids at a position, with their probabilities.

The SSD speculator guesses verification outcomes from these (the bonus token is likeliest among the
draft's top ids); the just-in-time drafter records them as it drafts, so the next build can reuse them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.device import read_together, to_device


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
        return ranked_rows(*read_together(self.take(index)))

    def take(self, index: list[int] | None = None) -> list[torch.Tensor]:
        """[ids, probs] of the rows in ``index`` (every row when None), still on their device: a caller
        reading other tensors too reads them together (``read_together``) and makes ``ranked_rows``."""
        if index is None:
            return [self.ids, self.probs]
        index = to_device(torch.tensor(index, dtype=torch.long), self.ids.device)
        return [self.ids[index], self.probs[index]]

    @staticmethod
    def empty(width: int, device: torch.device | str = "cpu") -> "RankTable":
        return RankTable(torch.zeros(0, width, dtype=torch.long, device=device),
                         torch.zeros(0, width, device=device))

    @staticmethod
    def cat(tables: list["RankTable"]) -> "RankTable":
        return RankTable(torch.cat([t.ids for t in tables]), torch.cat([t.probs for t in tables]))


def ranked_rows(ids: list[list[int]], probs: list[list[float]]) -> list[Ranked]:
    """``Ranked`` objects from a ``RankTable``'s rows, once read."""
    return [Ranked(i, p) for i, p in zip(ids, probs)]


def rank_table(logits: torch.Tensor, width: int) -> RankTable:
    """Per row of ``logits`` [N, V], the ``width`` most likely token ids and their probabilities."""
    logits = logits.float()
    top = torch.topk(logits, min(width, logits.shape[-1]), dim=-1)
    return RankTable(top.indices, (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp())


def rank_positions(logits: torch.Tensor, width: int) -> list[Ranked]:
    """``rank_table`` as one ``Ranked`` per row."""
    return rank_table(logits, width).rows()
