"""Per-request sampling settings, validated on construction.

Validation is what keeps one request from breaking a batch it shares: every value must be one the
sampling kernels compute with (finite floats, integers that fit their tensors), so no request can make
a row overflow or draw an id outside the vocabulary. Bad values raise ``ValueError`` naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
TOP_K_MAX = 2**31 - 1  # a vocabulary is never larger; top_k >= V disables the filter anyway


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 (or -1) disables top-k
    top_p: float = 1.0  # 1 disables nucleus filtering
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    ignore_eos: bool = False
    seed: int | None = None  # seeds the request's own torch.Generator
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end the request as EOS does
    skip_special_tokens: bool = True  # leave special tokens (chat markers, EOS) out of the text

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be an integer in [-1, {TOP_K_MAX}] (0 or -1 disables it), "
                             f"got {self.top_k!r}")
        self.top_k = max(self.top_k, 0)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative token ids, got {ids!r}")
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
