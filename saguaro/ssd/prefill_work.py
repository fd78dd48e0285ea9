"""The speculator's prefill, fed in pieces in its idle time, so that a long prompt never holds up a round.

The target sends a prompt to the speculator chunk by chunk (``CMD_PREFILL``, a growing prefix) while it
prefills its own cache. Fed on arrival, the draft's chunk held the speculator for the chunk's whole pass:
its arrival cut the running sequences' build short, and their next round waited for the pass to end before
it was answered. So a prefill now only records what each sequence's draft cache must come to hold
(``SeqState.prefilled``, with its blocks reserved); ``PrefillWork`` feeds that a piece at a time when the
speculator is idle -- its build done and no request waiting (``host.serve``) -- never between a request and
its response. A request that arrives during a piece waits for that piece alone.

A piece is as many tokens as fit ``piece_budget_s`` by the draft's own measured costs: the engine's auto
chunking (``prefill_chunks.TimedChunks``), which times every piece and refits the draft's cost per pass, per
token and per attended key. Its default is ``PIECE_SHARE`` of the device's prefill step budget (25 ms on a
CPU, 2.5 ms on a GPU): a running stream's token is late by at most about that. Several sequences' pending
tokens share a piece, oldest first.

What is still pending when the sequence is admitted is fed then, in one pass (``finish``): the admission and
the first speculation rely on the whole prefix.
"""
from __future__ import annotations

import time
from typing import Callable

from saguaro.engine.model_runner import DraftRunner, ForwardItem
from saguaro.engine.prefill_chunks import DEFAULT_BUDGET_S, TimedChunks
from saguaro.ssd.seq_state import SeqState

PIECE_SHARE = 0.1  # a piece's budget, as a share of the device's prefill step budget (DEFAULT_BUDGET_S)


def piece_budget_s(device_type: str) -> float:
    """The default time one piece of the speculator's prefill may take on this kind of device."""
    return PIECE_SHARE * DEFAULT_BUDGET_S.get(device_type, DEFAULT_BUDGET_S["cpu"])


class PrefillWork:
    """The prefill tokens the speculator has taken but not yet fed, and the feeding of them."""

    def __init__(self, runner: DraftRunner, budget_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.runner = runner
        budget = budget_s if budget_s is not None else piece_budget_s(runner.device.type)
        self.chunks = TimedChunks(budget, clock=clock)
        self.queued: list[int] = []  # sequence ids with prefill tokens to feed, oldest first

    def add(self, seq_id: int, state: SeqState) -> None:
        """``state.prefilled`` grew: reserve its blocks now (a full cache fails the prefill, as it always did) and
        queue what is not yet fed."""
        self.runner.blocks.reserve(state.draft.block_table, len(state.prefilled))
        if seq_id not in self.queued and _left(state):
            self.queued.append(seq_id)

    def pending(self, states: dict[int, SeqState]) -> list[SeqState]:
        """The sequences with tokens left to feed, oldest first (a released or admitted one drops out)."""
        self.queued = [i for i in self.queued if i in states and _left(states[i])]
        return [states[i] for i in self.queued]

    def piece(self, states: dict[int, SeqState]) -> bool:
        """Feed one piece; False if nothing was pending."""
        live = self.pending(states)
        if not live:
            return False
        counts = self.chunks.split([(_left(s), s.draft.num_cached) for s in live])
        self._feed([(s, n) for s, n in zip(live, counts) if n])
        return True

    def finish(self, state: SeqState) -> None:
        """Feed whatever of ``state``'s prefill is still pending, now (its admission needs it)."""
        if state.prefilled is not None and _left(state):
            self._feed([(state, _left(state))])

    def _feed(self, work: list[tuple[SeqState, int]]) -> None:
        items, rows = [], []
        for state, n in work:
            draft = state.draft
            start = draft.num_cached
            items.append(ForwardItem(state.prefilled[start:start + n], start, draft.block_table, "none",
                                     features=draft.features))
            rows.append((n, start))
            draft.num_cached = start + n
        with self.chunks.timing(rows, self.runner.device):
            self.runner.forward(items)


def _left(state: SeqState) -> int:
    """Prefill tokens of ``state`` not yet in its draft cache (none once a build's glue fed them, and more)."""
    return max(len(state.prefilled) - state.draft.num_cached, 0) if state.prefilled is not None else 0
