"""Paged KV-cache bookkeeping: which blocks each sequence owns.

A block table is a plain list of block ids owned by one sequence; token position ``p``
lives in slot ``table[p // block_size] * block_size + p % block_size``. The manager only
hands blocks out and takes them back, with exact accounting: a block is either free or
owned by exactly one table, and ``num_free`` returns to ``num_blocks`` once every table
is freed.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when a reservation cannot be met; callers preempt or queue instead."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_reserve(self, table: list[int], num_tokens: int) -> bool:
        return self.extra_blocks_needed(table, num_tokens) <= self.num_free

    def reserve(self, table: list[int], num_tokens: int) -> None:
        """Grow ``table`` in place until it can hold ``num_tokens`` tokens."""
        need = self.extra_blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block = self._free.popleft()
            self._owned.add(block)
            table.append(block)

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Give back blocks that positions ``>= num_tokens`` no longer need (rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._release(table.pop())

    def _release(self, block: int) -> None:
        if block not in self._owned:
            raise RuntimeError(f"block {block} released twice or never allocated")
        self._owned.remove(block)
        self._free.append(block)


def slots_for(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token positions ``start..end-1`` under a block table."""
    out: list[int] = []
    for b in range(start // block_size, -(-end // block_size)):  # a run of consecutive slots per block
        base = table[b] * block_size - b * block_size
        out.extend(range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size)))
    return out
