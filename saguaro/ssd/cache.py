"""The speculation cache: verification outcome -> speculation prepared in advance.

The keys are (sequence id, accepted count k, bonus token t*). The Python build knows them on the host: it
read the draft's ranking after the glue to choose them. The drafted tokens stay where the build drew them,
in one fixed-size ``[R, K]`` table on the draft's device (a row per branch), with the branches'
distributions and ranked ids beside it. ``respond`` gathers the rows that hit on the device and reads them
together with the misses' drafts, so a build ends without waiting for the device and a round's answer is
one read.

A graph build (``graph_build.py``) reads nothing: its keys stay on the device too (``fill_pending``). The
next ``respond`` looks its outcomes up there (``match``) and reads only which branch hit per sequence, with
the last speculations' tokens: the round's one read. The hits' tokens and ranked ids stay on the device
(``gather_spoken``), handed to the verifier and to the next build unread.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.device import read_together, to_device
from saguaro.sampling.ranked import RankTable
from saguaro.ssd.spoken import Spoken


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
        self._given: dict[int, tuple[int, int]] = {}  # the outcomes ``match`` looked up

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
        ``keys[n, q]``; rows past ``seq_ids`` are ghosts) stay on the device, where ``match`` looks outcomes up."""
        self.clear()
        self.tokens, self.ranks, self.probs = tokens, ranks, probs
        self._pending = (seq_ids, groups, keys)

    def match(self, outcomes: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """Look a graph build's sequences' outcomes (sequence id, k, t*) up in its key table, on the device: the
        outcomes staged in one copy, compared with every key there. Returns [n] long, the branch that hit for
        each of its n sequences (-1: none), for the round's one read (``matched``); None without a graph build."""
        if self._pending is None:
            return None
        seq_ids, _, keys = self._pending
        given = self._given = {seq_id: (k, t) for seq_id, k, t in outcomes}
        staged = to_device(torch.tensor([given.get(i, (-1, -1)) for i in seq_ids], dtype=torch.long), keys.device)
        same = (keys[:len(seq_ids)] == staged[:, None, :]).all(dim=-1)  # [n, branches]; keys are distinct
        return torch.where(same.any(dim=-1), same.to(torch.int8).argmax(dim=-1), -1)

    def matched(self, branches: list[int]) -> None:
        """Enter each graph-built sequence's branch that hit (``match``'s values, read), and only that one."""
        seq_ids, groups, _ = self._pending
        self._pending = None
        for seq_id, group, q in zip(seq_ids, groups, branches):
            self._entries[seq_id] = (group, {} if q < 0 else {self._given[seq_id]: q})

    def _read_pending(self) -> list[tuple[int, BranchGroup, dict[tuple[int, int], int]]]:
        """A graph build's every key, read (a read of its own: to inspect the cache, never on a round's path)."""
        seq_ids, groups, keys = self._pending
        values = read_together([keys[:len(seq_ids)]])[0]
        return [(i, g, {tuple(p): q for q, p in enumerate(pairs)}) for i, g, pairs in zip(seq_ids, groups, values)]

    def put(self, seq_id: int, keys: list[tuple[int, int]], group: BranchGroup) -> None:
        """Enter a sequence's branches: ``keys[q]`` = (k, t*), the outcome branch q was prepared for."""
        self._entries[seq_id] = (group, dict(zip(keys, range(len(keys)))))

    def get(self, seq_id: int, k: int, token: int) -> CachedBranch | None:
        if self._pending is not None:
            raise RuntimeError("a graph build's outcomes are looked up on the device: match, then matched")
        group, index = self._entries.get(seq_id, (None, {}))
        q = index.get((k, token))
        return None if q is None else group.branch(q)

    def gather(self, hits: list[CachedBranch]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """[tokens [H, K], rank ids [N, W], rank probs [N, W]] of ``hits`` on the device (the rank rows are every
        hit's ``rank_rows`` in order), for one read with others (``read_together``); and each hit's [length, V]
        distributions (None for a greedy one), gathered on the device in one index."""
        if not hits:
            return [], []
        rows = to_device(torch.tensor([h.row for h in hits], dtype=torch.long), self.tokens.device)
        pieces = [self.tokens[rows]] + self.ranks.take([r for h in hits for r in h.rank_rows])
        return pieces, self._hit_probs(hits)

    def gather_spoken(self, hits: list[CachedBranch], k: int) -> tuple[Spoken, list[torch.Tensor | None]]:
        """``gather`` left on the device as a ``Spoken`` of a row per hit (its ranked ids [K, W] per row, the
        rows past its length repeating its last: never staged as known), in one index copy and three gathers."""
        index = [[h.row] + [h.rank_rows[min(j, h.length - 1)] if h.length else 0 for j in range(k)] for h in hits]
        index = to_device(torch.tensor(index, dtype=torch.long), self.tokens.device)
        rank_rows = index[:, 1:]
        spoken = Spoken(self.tokens[index[:, 0]].clamp(min=0), self.ranks.ids[rank_rows], self.ranks.probs[rank_rows])
        return spoken, self._hit_probs(hits)

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
        self._pending = None

    def _all(self) -> list[tuple[int, BranchGroup, dict[tuple[int, int], int]]]:
        if self._pending is not None:
            return self._read_pending()
        return [(seq_id, group, index) for seq_id, (group, index) in self._entries.items()]

    def keys(self) -> list[tuple[int, int, int]]:
        return [(seq_id, k, t) for seq_id, _, index in self._all() for k, t in index]

    def items(self) -> list[tuple[tuple[int, int, int], CachedBranch]]:
        return [((seq_id, k, t), group.branch(q)) for seq_id, group, index in self._all()
                for (k, t), q in index.items()]

    def __len__(self) -> int:
        return sum(len(index) for _, _, index in self._all())
