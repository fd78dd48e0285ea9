"""Continuous batching over the target's paged KV cache.

Each step is either a prefill batch (admit waiting requests whose blocks fit) or a decode
batch (every running request advances one round). A decode round may write up to
``lookahead`` new positions per sequence (1 for AR, K+1 for speculative verification);
blocks for them are reserved up front. When blocks run out, the most recently admitted
request is preempted: its blocks are freed and it goes back to the front of the queue,
to be recomputed later. Nothing crashes and no request is dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from saguaro.engine.sequence import Sequence, Status
from saguaro.kv.block_manager import BlockManager


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_prefill_tokens: int,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int) -> Batch | None:
        admitted = self._admit(lookahead)
        if admitted:
            return Batch(admitted, is_prefill=True)
        if not self.running:
            return None
        self._reserve_decode(lookahead)
        return Batch(list(self.running), is_prefill=False)

    def _admit(self, lookahead: int) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = len(seq) + lookahead  # prompt now, plus room for the first decode round
            if admitted and len(seq) > budget:
                break
            if not self.blocks.can_reserve(seq.block_table, need):
                break
            self.waiting.popleft()
            self.blocks.reserve(seq.block_table, len(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            budget -= len(seq)
        return admitted

    def _reserve_decode(self, lookahead: int) -> None:
        """Make room for ``lookahead`` new positions per running sequence, preempting if needed."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = seq.num_cached + lookahead
            while not self.blocks.can_reserve(seq.block_table, need):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.reserve(seq.block_table, need)
                i += 1

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.on_preempt(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
