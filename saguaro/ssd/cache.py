"""The speculation cache: verification outcome -> speculation prepared in advance.

The keys are (sequence id, accepted count k, bonus token t*). The Python build knows them on the host: it
read the draft's ranking after the glue to choose them. The drafted tokens stay where the build drew them,
in one fixed-size ``[R, K]`` table on the draft's device (a row per branch), with the branches'
distributions and ranked ids beside it. ``respond`` gathers the rows that hit on the device and reads them
together with the misses' drafts, so a build ends without waiting for the device and a round's answer is
one read.

A graph build (``graph_build.py``) reads nothing: its keys stay on the device too (``fill_pending``).
``resolve``, at the start of the next ``respond``, reads its keys, token table and ranked ids in one read;
the hits' tokens are then on the host already, and the round reads the device again only for the misses'
just-in-time drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.device import read_together, to_device
from saguaro.sampling.ranked import RankTable


@dataclass
class BranchGroup:
    """One sequence's branches in a build, branch q being its q-th likeliest outcome. What a branch needs is
    spelled out only when it is looked up (``CachedBranch``): a build at batch 1,024 holds thousands of
    branches and a round hits at most one per sequence."""
    first_row: int  # the token table's row of branch 0 (branch q's is first_row + q)
    branches: int  # how many (the table's rows first_row .. first_row + branches - 1)
    step_rows: list[int]  # the pass row (numbered across the build's steps) of branch 0 at each step decoded
    widths: list[int]  # branches decoded at each of those steps, non-increasing
    sampled: bool  # its draws keep their distributions (a sampled sequence)
    scratch: list[int]  # the build's scratch slots: step j of branch q wrote its k/v to scratch[offsets[j] + q]
    offsets: list[int]

    def branch(self, q: int) -> CachedBranch:
        length = sum(w > q for w in self.widths)  # widths never grow: branch q is decoded at steps 0..length-1
        return CachedBranch(self.first_row + q, length, [r + q for r in self.step_rows[:length]],
                            [self.scratch[o + q] for o in self.offsets[:length]], self.sampled)


@dataclass
class CachedBranch:
    """One branch of a build: the speculation prepared for one outcome (k, t*), its tokens in the table."""
    row: int  # row of the build's token table
    length: int  # tokens drafted after the outcome's bonus token (fewer than K if the build was cut short)
    # rows of the build's rank table (and of its distributions): the draft's most likely ids at the position each
    # token was drawn for (the next build's outcome guesses at depth j, so that build need not re-run these)
    rank_rows: list[int]
    kv_slots: list[int]  # scratch KV slots of the bonus token and tokens[:-1] (what the next glue would recompute)
    sampled: bool  # its tokens were drawn from distributions, which ``gather`` hands out


class SpeculationCache:
    """One build's speculations: host keys, device token table; cleared every round."""

    def __init__(self) -> None:
        # sequence id -> (its branches, outcome (k, t*) -> branch q): a dict per sequence, made in one call
        self._entries: dict[int, tuple[BranchGroup, dict[tuple[int, int], int]]] = {}
        self.tokens: torch.Tensor | None = None  # [R, K] long on the draft's device; -1 past a row's length
        self.ranks: RankTable | None = None  # every position of every branch, ranked
        self.probs: torch.Tensor | None = None  # [rows, V] every pass row's distribution; None if all greedy
        self._pending: tuple[list[int], list[BranchGroup], torch.Tensor] | None = None  # a graph build's keys
        self._host: list[list] | None = None  # [tokens, rank ids, rank probs] as read by ``resolve``

    def fill(self, groups: list[BranchGroup], drawn: list[torch.Tensor], ranks: RankTable | None,
             probs: torch.Tensor | None, k: int, device: torch.device) -> None:
        """Start a build's cache (entries follow with ``put``): its rank table and distributions, and its [R, K]
        token table scattered on ``device`` from the steps' drawn tokens in one write.

        ``drawn[j]``: the tokens of step j's pass, a row per decoded branch, ``groups`` in order (each its first
        ``widths[j]`` branches); ``groups``' ``first_row``s number the table's rows in the same order."""
        table = torch.full((sum(g.branches for g in groups), k), -1, dtype=torch.long, device=device)
        if drawn:  # pass row r of step j, branch q of group g -> cell (first_row + q, j): a run per group and step
            cell: list[int] = []
            for j in range(len(drawn)):
                for g in groups:
                    cell.extend(range(g.first_row * k + j, (g.first_row + g.widths[j]) * k + j, k))
            table.view(-1)[to_device(torch.tensor(cell, dtype=torch.long), device)] = torch.cat(drawn).to(device)
        self.clear()
        self.tokens, self.ranks, self.probs = table, ranks, probs

    def fill_pending(self, seq_ids: list[int], groups: list[BranchGroup], keys: torch.Tensor, tokens: torch.Tensor,
                     ranks: RankTable, probs: torch.Tensor | None) -> None:
        """Start a graph build's cache: ``keys`` [B, branches, 2] (sequence n's branch q was prepared for outcome
        ``keys[n, q]``; rows past ``seq_ids`` are ghosts) stay on the device until ``resolve``."""
        self.clear()
        self.tokens, self.ranks, self.probs = tokens, ranks, probs
        self._pending = (seq_ids, groups, keys)

    def resolve(self) -> None:
        """Read a graph build's keys, token table and ranked ids in one read, and enter its sequences."""
        if self._pending is None:
            return
        seq_ids, groups, keys = self._pending
        self._pending = None
        values = read_together([keys[:len(seq_ids)], self.tokens, self.ranks.ids, self.ranks.probs])
        for seq_id, group, pairs in zip(seq_ids, groups, values[0]):
            self.put(seq_id, [tuple(p) for p in pairs], group)
        self._host = values[1:]

    def put(self, seq_id: int, keys: list[tuple[int, int]], group: BranchGroup) -> None:
        """Enter a sequence's branches: ``keys[q]`` = (k, t*), the outcome branch q was prepared for."""
        self._entries[seq_id] = (group, dict(zip(keys, range(len(keys)))))

    def get(self, seq_id: int, k: int, token: int) -> CachedBranch | None:
        self.resolve()
        group, index = self._entries.get(seq_id, (None, {}))
        q = index.get((k, token))
        return None if q is None else group.branch(q)

    def gather(self, hits: list[CachedBranch]
               ) -> tuple[list[list] | None, list[torch.Tensor], list[torch.Tensor | None]]:
        """[tokens [H, K], rank ids [N, W], rank probs [N, W]] of ``hits`` (the rank rows are every hit's
        ``rank_rows`` in order): as Python values where ``resolve`` read them already (else None), or on the
        device, for one read with others (``read_together``); and each hit's [length, V] distributions (None for
        a greedy one), gathered on the device in one index."""
        if not hits:
            return ([[], [], []] if self._host is not None else None), [], []
        values, pieces = None, []
        if self._host is not None:
            tokens, ids, probs = self._host
            rank_rows = [r for h in hits for r in h.rank_rows]
            values = [[tokens[h.row] for h in hits], [ids[r] for r in rank_rows], [probs[r] for r in rank_rows]]
        else:
            rows = to_device(torch.tensor([h.row for h in hits], dtype=torch.long), self.tokens.device)
            pieces = [self.tokens[rows]] + self.ranks.take([r for h in hits for r in h.rank_rows])
        return values, pieces, self._hit_probs(hits)

    def _hit_probs(self, hits: list[CachedBranch]) -> list[torch.Tensor | None]:
        probs: list[torch.Tensor | None] = [None] * len(hits)
        sampled = [b for b, h in enumerate(hits) if h.sampled]
        if sampled:
            index = torch.tensor([r for b in sampled for r in hits[b].rank_rows], dtype=torch.long)
            blocks = self.probs[to_device(index, self.probs.device)].split([hits[b].length for b in sampled])
            for b, block in zip(sampled, blocks):
                probs[b] = block
        return probs

    def read_tokens(self, branch: CachedBranch) -> list[int]:
        """One entry's tokens (a read of its own; the engine reads hits through ``gather``)."""
        return self.tokens[branch.row, :branch.length].tolist()

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = self.ranks = self.probs = None
        self._pending = self._host = None

    def keys(self) -> list[tuple[int, int, int]]:
        self.resolve()
        return [(seq_id, k, t) for seq_id, (_, index) in self._entries.items() for k, t in index]

    def items(self) -> list[tuple[tuple[int, int, int], CachedBranch]]:
        self.resolve()
        return [((seq_id, k, t), group.branch(q)) for seq_id, (group, index) in self._entries.items()
                for (k, t), q in index.items()]

    def __len__(self) -> int:
        self.resolve()
        return sum(len(index) for _, index in self._entries.values())
