"""How a draft model runs: its weight format and how much of its vocabulary its head keeps.

A draft's arithmetic never touches exactness: the verifier accepts or rejects against the
distribution q the draft actually sampled from (or, greedy, against the target's argmax), so
any draft that proposes tokens keeps SD and SSD lossless. What a cheaper draft buys is a
shorter draft step, which is what SD's drafting and SSD's tree build pay for.

  * ``weights="int8"``: every matrix quantized per output channel, activations per block of
    32 (W8A8; see saguaro/backends/cpu_kernels/csrc/quant_pack.h). Half the bytes of bf16.
  * ``weights="int4"``: every matrix quantized per group of 32 inputs, 16 levels from the
    group's min to its max (W4A8): 5 bits a weight with the fp16 scale and offset. The Qwen
    drafts ship as GGUF Q4_K, whose blocks already lie on such a grid, so little is lost
    (measured: the same HumanEval acceptance as int8; a 1-row 0.5B step of 11 ms against int8's
    17.5-20 ms and bf16's 31.5 ms; from ~8 rows on the step is compute-bound and int4 gains nothing).
  * ``vocab=N``: the output head keeps only token ids below N, plus the special tokens
    (EOS, chat markers). Byte-level BPE vocabularies list tokens in merge order, most
    frequent first, so a prefix keeps the common ones: the first 65,536 of Qwen2.5's 151,936
    ids cover 99.2% of HumanEval solution tokens and 97.9% of MT-Bench question tokens.
    The head is a quarter of the 0.5B draft's bytes; a draft never proposes a dropped token
    (its logit is -inf, so q = 0 there).

Both need the fast path (a bf16 model on CPU, any kernel tier); such a draft is loaded in bf16
whatever the target's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:  # a hint only: loading builds models, not the other way round
    from saguaro.loading import LoadedModel


WEIGHT_FORMATS = ("bf16", "int8", "int4")  # how the CPU kernels can pack a matrix (backends/cpu_kernels)


@dataclass(frozen=True)
class DraftFormat:
    weights: str = "bf16"
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"draft_weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.vocab is not None and self.vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.vocab}")

    @property
    def custom(self) -> bool:
        """Whether the draft needs the fast path (and bf16) whatever the engine's settings."""
        return self.weights != "bf16" or self.vocab is not None

    @property
    def tag(self) -> str:
        """A short name for this format ("" for the plain draft): keys the calibration profile."""
        parts = [self.weights] if self.weights != "bf16" else []
        if self.vocab is not None:
            parts.append(f"v{self.vocab}")
        return "-".join(parts)

    def dtype(self, engine_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.custom else engine_dtype

    def head_ids(self, draft: LoadedModel) -> torch.Tensor | None:
        """Token ids the draft head keeps: ids below ``vocab`` and every special token."""
        if self.vocab is None:
            return None
        v = draft.config.vocab_size
        keep = set(range(min(self.vocab, v))) | {i for i in draft.tokenizer.special_ids() if i < v}
        return torch.tensor(sorted(keep), dtype=torch.long)
