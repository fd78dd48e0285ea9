"""What an SD proposer hands the verifier, and the proposer protocol."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from saguaro.engine.sequence import Sequence
from saguaro.sampling.ranked import RankTable


@dataclass
class Proposal:
    """Drafted tokens for a batch, and the distributions they were drawn from.

    ``tokens[b]`` holds up to K tokens for sequence ``b``. ``probs[b, i]`` is the exact
    distribution token ``i`` was sampled from (after temperature, top-k/top-p and any
    Saguaro down-weighting), which verification must use to stay lossless. Rows whose
    proposer is deterministic (n-gram) have ``point_mass[b] = True`` and no distribution.

    A proposal asked not to read its tokens (``propose(..., read=False)``) leaves them on the draft's
    device: ``tokens`` is None, ``device_tokens`` holds them and ``counts`` says how many each row has. The
    verifier then reads them together with its outcome, so an SD round reads from the device once.
    """
    tokens: list[list[int]] | None
    probs: torch.Tensor | None  # [B, K, V] float32, or None when every row is a point mass
    point_mass: torch.Tensor  # [B] bool
    device_tokens: torch.Tensor | None = None  # [B, max(K, 1)] long; row b's first counts[b] are its drafts
    counts: list[int] | None = None  # drafts per row when ``tokens`` is None
    # the draft's most likely ids at the position of each token, on the device (only when the proposer was
    # asked to keep them: the SSD speculator reuses them as the next round's outcome guesses):
    # rank_rows[b][i] is the row of rank_table that ranks token i of sequence b
    rank_table: RankTable | None = None
    rank_rows: list[list[int]] | None = None

    def __post_init__(self) -> None:
        on_device = self.tokens is None
        if on_device != (self.device_tokens is not None) or on_device != (self.counts is not None):
            raise ValueError("a proposal holds either its token lists or device_tokens with counts")

    def num_drafts(self) -> list[int]:
        return [len(t) for t in self.tokens] if self.tokens is not None else list(self.counts)

    @staticmethod
    def deterministic(tokens: list[list[int]]) -> "Proposal":
        return Proposal(tokens, None, torch.ones(len(tokens), dtype=torch.bool))


class Proposer(ABC):
    """Proposes draft tokens synchronously (SD) and tracks per-sequence draft state."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int], read: bool = True) -> Proposal:
        """Draft ``num_tokens[b]`` tokens after all of ``seqs[b]``'s tokens. ``read=False`` lets a proposer
        whose tokens live on a device leave them there (see ``Proposal``); others ignore it."""

    def prefill(self, seqs: list[Sequence], ends: list[int] | None = None) -> None:
        """The engine is prefilling these sequences in the target (up to ``ends[i]`` tokens, a chunk; None: all):
        catch up on as many of their tokens now, so the draft's prompt prefill counts in the prefill (time to
        first token) and not in the first round."""

    def commit(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The verifier kept ``num_accepted`` drafts and appended a bonus token."""

    def backlog(self, seq: Sequence) -> int:
        """Tokens of ``seq`` its next proposal feeds before its first draft (1 after a round that drafted: the
        bonus token; more after rounds at K = 0, whose tokens the draft skipped). 0: nothing to feed."""
        return 0

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence."""
