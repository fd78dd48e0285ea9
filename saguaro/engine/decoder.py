"""The decode-round seam: AR, SD and SSD each implement one ``Decoder``.

The engine owns scheduling, prefill and stopping; a decoder only advances a batch of
running sequences by one round and says how many target positions a round may write.
Invariant on entry and exit: the target cache holds every token of a sequence except
the last one (``seq.num_cached == len(seq) - 1``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sampling.batch import sample_next


class Decoder(ABC):
    lookahead: int = 1  # target positions one round may write per sequence
    reports_spec: bool = False  # whether rounds carry speculation metrics
    reports_cache: bool = False  # whether rounds carry SSD cache-hit metrics

    @abstractmethod
    def decode(self, seqs: list[Sequence]) -> list[list[int]]:
        """Advance each sequence by one round; return the new tokens per sequence."""

    def prefilling(self, seqs: list[Sequence], ends: list[int]) -> None:
        """The engine is about to feed the target ``seqs[i].tokens[:ends[i]]`` (a prefill chunk; the prompt is
        complete when ``ends[i] == seqs[i].prefill_end``). A draft may prefill as far meanwhile."""

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state (on finish or preemption)."""

    def close(self) -> None:
        """Stop helper processes, if any."""


class ARDecoder(Decoder):
    """Plain autoregressive decoding: one target forward, one token per sequence."""

    def __init__(self, target: ModelRunner):
        self.target = target

    def decode(self, seqs: list[Sequence]) -> list[list[int]]:
        items = [ForwardItem([seq.last_token], seq.num_cached, seq.block_table) for seq in seqs]
        logits, _ = self.target.forward_flat(items)
        for seq in seqs:
            seq.num_cached += 1
        return [[t] for t in sample_next(logits, seqs)]
