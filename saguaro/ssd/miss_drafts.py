"""A round's answer for the sequences the speculation cache missed (their drafts, by the miss strategy),
before it is read.

The just-in-time drafter leaves its drafts and ranked ids on the draft's device; ``respond`` reads them
together with the hits it gathered there (``pieces``), then makes the rows (``answer``). A point-mass
backup (n-gram / random) drafts on the host and has nothing to read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.sampling.ranked import ranked_rows
from saguaro.sd.types import Proposal
from saguaro.ssd.protocol import SpecRow
from saguaro.ssd.seq_state import SeqState


@dataclass
class MissDrafts:
    """The misses' speculations: a just-in-time proposal still on the draft's device, or point-mass tokens."""
    proposal: Proposal | None = None
    point_mass: list[list[int]] | None = None

    @property
    def pieces(self) -> list[torch.Tensor]:
        """What the host must read: the drafts, then their ranked ids."""
        if self.proposal is None:
            return []
        return [self.proposal.device_tokens] + self.proposal.rank_table.take()

    def answer(self, states: list[SeqState], values: list[list]) -> list[tuple[int, SpecRow]]:
        """(sequence id, row) per state, from ``pieces``' values; records each state's ranked ids."""
        if self.proposal is None:
            return [(s.seq.seq_id, SpecRow(False, toks, None, point_mass=True))
                    for s, toks in zip(states, self.point_mass or [])]
        p = self.proposal
        every = ranked_rows(values[1], values[2])
        out = []
        for b, (s, row, n) in enumerate(zip(states, values[0], p.counts)):
            s.ranked = [every[r] for r in p.rank_rows[b]]
            out.append((s.seq.seq_id, SpecRow(False, row[:n], None if s.seq.params.greedy else p.probs[b, :n].clone())))
        return out
