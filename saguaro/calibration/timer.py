"""Timing one forward pass of a model over n new rows, after a fixed cached context.

Shared by the timing tables of a calibration (``measure.time_rows``) and the memory-bus
contention probe (``contention.measure``). Token ids are made up: only the cost matters.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from saguaro.engine.model_runner import ForwardItem, ModelRunner, draft_runner
from saguaro.models.draft_format import DraftFormat


def runner_factory(loaded, enforce_eager: bool, draft_format: DraftFormat | None = None,
                   target_weights: str = "bf16") -> Callable[[int, int], ModelRunner]:
    """``make_runner`` for a ``RowTimer``: a target as the engine runs it (``draft_format`` None; its weights
    packed as ``target_weights``), or a draft in its format, on the CPU."""
    if draft_format is None:
        return lambda n, block_size: ModelRunner(loaded.model, n, block_size, enforce_eager=enforce_eager,
                                                 weights=target_weights)
    return lambda n, block_size: draft_runner(draft_format, loaded, n, block_size, "cpu", enforce_eager)


class RowTimer:
    """One model with ``context`` cached tokens; ``once(n)`` times a forward over n new rows (all logits),
    rewriting the same cache slots each time.

    ``make_runner(num_blocks, block_size)`` builds the model's runner (so a draft runs in its format)."""

    def __init__(self, make_runner: Callable[[int, int], ModelRunner], context: int, max_rows: int,
                 block_size: int = 16):
        self.runner = make_runner(math.ceil((context + max_rows) / block_size) + 1, block_size)
        vocab = self.runner.config.vocab_size
        self.table: list[int] = []
        self.runner.blocks.reserve(self.table, context + max_rows)
        self.tokens = [(101 + 7 * i) % vocab for i in range(context + max_rows)]
        self.context = context
        self.runner.forward([ForwardItem(self.tokens[:context], 0, self.table, "none")])

    @torch.inference_mode()
    def once(self, n: int) -> float:
        start = time.perf_counter()
        self.runner.forward([ForwardItem(self.tokens[self.context:self.context + n], self.context, self.table, "all")])
        return time.perf_counter() - start
