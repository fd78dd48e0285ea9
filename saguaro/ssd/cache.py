"""The speculation cache: verification outcome -> speculation prepared in advance.

The keys, (sequence id, accepted count k, bonus token t*), are known on the host: the build read the
draft's ranking after the glue to choose them. The drafted tokens are not: they stay where the build drew
them, in one fixed-size ``[R, K]`` table on the draft's device (a row per branch), with the branches'
distributions and ranked ids beside it. ``respond`` gathers the rows that hit on the device and reads them
together with the misses' drafts, so a build ends without waiting for the device and a round's answer is
one read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.device import to_device
from saguaro.sampling.ranked import RankTable


@dataclass
class CachedBranch:
    """One branch of a build: the speculation prepared for one outcome (k, t*), its tokens in the table."""
    row: int  # row of the build's token table
    length: int  # tokens drafted after the outcome's bonus token (fewer than K if the build was cut short)
    probs: torch.Tensor | None  # [length, V] distributions they were drawn from; None for greedy rows
    # rows of the build's rank table: the draft's most likely ids at the position each token was drawn for
    # (the next build's outcome guesses at depth j, so that build need not re-run these positions)
    rank_rows: list[int]
    # where its k/v sits: step j's slot is scratch[offsets[j] + index] (the build's lists, shared by its branches;
    # only a hit reads them, so no branch spells its slots out)
    scratch: list[int]
    offsets: list[int]
    index: int

    @property
    def kv_slots(self) -> list[int]:
        """Scratch KV slots of the bonus token and tokens[:-1] (what the next build's glue would recompute)."""
        return [self.scratch[o + self.index] for o in self.offsets[:self.length]]


class SpeculationCache:
    """One build's speculations: host keys, device token table; cleared every round."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], CachedBranch] = {}
        self.tokens: torch.Tensor | None = None  # [R, K] long on the draft's device; -1 past a row's length
        self.ranks: RankTable | None = None  # every position of every branch, ranked

    def fill(self, branch_rows: list[list[int]], drawn: list[torch.Tensor], ranks: RankTable | None, k: int,
             device: torch.device) -> None:
        """Start a build's cache (entries follow with ``put``): its rank table, and its [R, K] token table
        scattered on ``device`` from the steps' drawn tokens in one write.

        ``drawn[j]``: the tokens of step j's pass, a row each; ``branch_rows[b]``: the pass rows (numbered
        across the steps, in order) that drew branch b's tokens, one per step it was decoded."""
        table = torch.full((len(branch_rows), k), -1, dtype=torch.long, device=device)
        if drawn:  # pass row r of step j -> cell (b, j)
            cell = [0] * sum(len(d) for d in drawn)
            for b, rows in enumerate(branch_rows):
                for j, r in enumerate(rows):
                    cell[r] = b * k + j
            flat = to_device(torch.tensor(cell, dtype=torch.long), device)
            table.view(-1)[flat] = torch.cat(drawn).to(device)
        self._entries.clear()
        self.tokens, self.ranks = table, ranks

    def put(self, seq_id: int, k: int, token: int, branch: CachedBranch) -> None:
        self._entries[(seq_id, k, token)] = branch

    def get(self, seq_id: int, k: int, token: int) -> CachedBranch | None:
        return self._entries.get((seq_id, k, token))

    def gather(self, hits: list[CachedBranch]) -> list[torch.Tensor]:
        """[tokens [H, K], rank ids [N, W], rank probs [N, W]] of ``hits`` on the device, for one read
        (``read_together``); the rank rows are every hit's ``rank_rows`` in order."""
        device = self.tokens.device
        rows = to_device(torch.tensor([h.row for h in hits], dtype=torch.long), device)
        ranks = self.ranks.take([r for h in hits for r in h.rank_rows])
        return [self.tokens[rows]] + ranks

    def read_tokens(self, branch: CachedBranch) -> list[int]:
        """One entry's tokens (a read of its own; the engine reads hits through ``gather``)."""
        return self.tokens[branch.row, :branch.length].tolist()

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = self.ranks = None

    def keys(self) -> list[tuple[int, int, int]]:
        return list(self._entries)

    def items(self) -> list[tuple[tuple[int, int, int], CachedBranch]]:
        return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)


def branch_probs(sampled: list[bool], rows_of: dict[tuple[int, int], list[int]],
                 all_probs: list[torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """[len(tokens), V] distributions of every branch (i, q) of a sampled sequence i (``sampled[i]``), from the
    build's steps' rows (``all_probs``, numbered across the steps as ``rows_of`` numbers them): one gather per
    branch length."""
    by_length: dict[int, list[tuple[int, int]]] = {}
    for (i, q), rows in rows_of.items():
        if sampled[i]:
            by_length.setdefault(len(rows), []).append((i, q))
    if not by_length:
        return {}
    flat = torch.cat(all_probs)
    out = {}
    for members in by_length.values():
        index = to_device(torch.tensor([rows_of[m] for m in members]), flat.device)
        gathered = flat[index]  # [branches, length, V]
        out.update(zip(members, gathered))
    return out
