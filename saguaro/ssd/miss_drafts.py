"""A round's answer for the sequences the speculation cache missed (their drafts, by the miss strategy),
before it is read.

The just-in-time drafter leaves its drafts and ranked ids on the draft's device; ``respond`` reads them
together with the hits it gathered there (``pieces``), then makes the rows (``answer``), or on the graph-build
path leaves them there unread (``spoken``, ``answer_on_device``). A point-mass backup (n-gram / random) drafts
on the host and has nothing to read; miss strategy "skip" answers with empty rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.device import to_device
from saguaro.sampling.ranked import ranked_rows
from saguaro.sd.types import Proposal
from saguaro.ssd.protocol import SpecRow
from saguaro.ssd.seq_state import SeqState
from saguaro.ssd.spoken import Spoken, SpokenRow


@dataclass
class MissDrafts:
    """The misses' speculations: a just-in-time proposal still on the draft's device, or point-mass tokens."""
    proposal: Proposal | None = None
    point_mass: list[list[int]] | None = None
    empty: bool = False  # miss strategy "skip": empty rows, no backup's speculation (built after as the primary's)

    @property
    def pieces(self) -> list[torch.Tensor]:
        """What the host must read: the drafts, then their ranked ids."""
        if self.proposal is None:
            return []
        return [self.proposal.device_tokens] + self.proposal.rank_table.take()

    def spoken(self, k: int) -> Spoken:
        """The just-in-time drafts and their ranked ids as a ``Spoken`` (a row per sequence, K columns), left on
        the device: one index copy and two gathers (a row's positions past its drafts repeat its last ranking)."""
        p = self.proposal
        tokens = torch.nn.functional.pad(p.device_tokens, (0, k - p.device_tokens.shape[1]))
        table = p.rank_table
        if not any(p.rank_rows):  # nothing drafted
            width = table.ids.shape[1]
            return Spoken(tokens, tokens.new_zeros(len(tokens), k, width), table.probs.new_zeros(len(tokens), k, width))
        index = [[rows[min(j, len(rows) - 1)] if rows else 0 for j in range(k)] for rows in p.rank_rows]
        index = to_device(torch.tensor(index, dtype=torch.long), table.ids.device)
        return Spoken(tokens, table.ids[index], table.probs[index])

    def answer_on_device(self, states: list[SeqState], tokens: list[torch.Tensor], first: int
                         ) -> list[tuple[int, SpecRow]]:
        """(sequence id, row) per state, its tokens left on the device (``tokens[b]``, row ``first + b`` of the
        round's ``Spoken``); records where each state's speculation waits."""
        p, out = self.proposal, []
        for b, (s, row, n) in enumerate(zip(states, tokens, p.counts)):
            s.ranked, s.spoken = None, SpokenRow(first + b, n, len(p.rank_rows[b]))
            probs = None if s.seq.params.greedy else p.probs[b, :n].clone()
            out.append((s.seq.seq_id, SpecRow(False, None, probs, device_tokens=row, count=n)))
        return out

    def answer(self, states: list[SeqState], values: list[list]) -> list[tuple[int, SpecRow]]:
        """(sequence id, row) per state, from ``pieces``' values; records each state's ranked ids."""
        if self.proposal is None:
            return [(s.seq.seq_id, SpecRow(False, toks, None, point_mass=not self.empty))
                    for s, toks in zip(states, self.point_mass or [])]
        p = self.proposal
        every = ranked_rows(values[1], values[2])
        out = []
        for b, (s, row, n) in enumerate(zip(states, values[0], p.counts)):
            s.ranked = [every[r] for r in p.rank_rows[b]]
            out.append((s.seq.seq_id, SpecRow(False, row[:n], None if s.seq.params.greedy else p.probs[b, :n].clone())))
        return out
