"""Continuous batching over the target's paged KV cache, with chunked prefill.

Each step is either a prefill step or a decode step. Waiting requests are admitted when their
prompt's blocks fit; an admitted request is *prefilling* until its prompt is in the cache, fed
a chunk per step over all prefilling requests (a long prompt takes several steps): at most
``max_prefill_tokens`` tokens, or with "auto" as many as fit a step's time budget
(``saguaro.engine.prefill_chunks``). While requests are decoding, prefill and decode steps
alternate, so a long prompt delays the running streams by one chunk per token, never by its whole
prefill.

A decode round may write up to ``lookahead`` new positions per sequence (1 for AR, K+1 for
speculative verification); blocks for them are reserved up front. When blocks run out, the most
recently admitted request is preempted (a prefilling one first): its blocks are freed and it goes
back to the front of the queue, to be recomputed later. Nothing crashes and no request is dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from saguaro.engine.prefill_chunks import FixedChunks
from saguaro.engine.sequence import Sequence, Status
from saguaro.kv.block_manager import BlockManager


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool
    chunks: list[int] = field(default_factory=list)  # prefill: tokens each sequence feeds this step


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, chunks: FixedChunks,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.chunks = chunks  # how many prompt tokens a step feeds
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted; their prompt is partly in the cache
        self.running: list[Sequence] = []  # decoding
        self.num_preemptions = 0
        self._decode_next = False  # alternate prefill chunks with decode rounds

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self, lookahead: int) -> Batch | None:
        self._admit(lookahead)
        if self.prefilling and not (self.running and self._decode_next):
            self._decode_next = True
            return self._prefill_batch()
        self._decode_next = False
        if not self.running:
            return None
        self._reserve_decode(lookahead)
        return Batch(list(self.running), is_prefill=False)

    def _admit(self, lookahead: int) -> None:
        """Admit waiting requests while the next chunk has room for them (so blocks are not held idle)."""
        pending = sum(s.prefill_end - s.num_cached for s in self.prefilling)
        while (self.waiting and pending < self.chunks.step_tokens
               and len(self.running) + len(self.prefilling) < self.max_num_seqs):
            seq = self.waiting[0]
            if not self.blocks.can_reserve(seq.block_table, len(seq) + lookahead):  # + the first decode round
                break
            self.waiting.popleft()
            self.blocks.reserve(seq.block_table, len(seq))
            seq.status = Status.RUNNING
            self.prefilling.append(seq)
            pending += seq.prefill_end - seq.num_cached

    def _prefill_batch(self) -> Batch:
        """The next chunk: prefilling requests in admission order, as many tokens as ``chunks`` gives them."""
        sizes = self.chunks.split([(seq.prefill_end - seq.num_cached, seq.num_cached) for seq in self.prefilling])
        fed = [(seq, n) for seq, n in zip(self.prefilling, sizes) if n > 0]
        return Batch([seq for seq, _ in fed], is_prefill=True, chunks=[n for _, n in fed])

    def prefilled(self, seq: Sequence) -> None:
        """``seq``'s prompt is in the cache: it decodes from the next round on."""
        self.prefilling.remove(seq)
        self.running.append(seq)

    def _reserve_decode(self, lookahead: int) -> None:
        """Make room for ``lookahead`` new positions per running sequence, preempting if needed."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = seq.num_cached + lookahead
            while not self.blocks.can_reserve(seq.block_table, need):
                victim = self.prefilling[-1] if self.prefilling else self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.reserve(seq.block_table, need)
                i += 1

    def preempt(self, seq: Sequence) -> None:
        (self.prefilling if seq in self.prefilling else self.running).remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.on_preempt(seq)

    def finish(self, seq: Sequence) -> None:
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
                break
        self.blocks.free(seq.block_table)
