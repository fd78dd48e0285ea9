"""Per-request sampling settings, validated on construction.

Validation is what keeps one request from breaking a batch it shares: every value must be one the
sampling kernels compute with (finite floats, integers that fit their tensors), so no request can make
a row overflow or draw an id outside the vocabulary. Bad values raise ``ValueError`` naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from saguaro.sampling.grammar import JsonGrammar

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
TOP_K_MAX = 2**31 - 1  # a vocabulary is never larger; top_k >= V disables the filter anyway
MAX_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2], as OpenAI's API sets them
MAX_LOGPROBS = 20  # the most top alternatives a request may ask for per token (vLLM's default bound)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100], as OpenAI's API sets it


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
    # logit processors (saguaro.sampling.logit_processors), applied to the target's logits before temperature
    frequency_penalty: float = 0.0  # minus this times a token's count in the output so far
    presence_penalty: float = 0.0  # minus this once a token is in the output
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) the logits of tokens in prompt or output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the request (or be sampled) before this many tokens
    logprobs: int | None = None  # each output token's logprob and its top-N alternatives (sampling.logprobs)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (then max_tokens may be 0)
    grammar: JsonGrammar | None = None  # the output must be this JSON (sampling.grammar), masked on the target


    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be an integer in [-1, {TOP_K_MAX}] (0 or -1 disables it), "
                             f"got {self.top_k!r}")
        self.top_k = max(self.top_k, 0)
        if not _is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs), "
                             f"got {self.max_tokens!r}")
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
        self._check_processors()
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_processors(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                             f"got {self.repetition_penalty!r}")
        bias = self.logit_bias
        if not isinstance(bias, dict) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in bias):
            raise ValueError(f"logit_bias must map non-negative token ids to numbers, got {bias!r}")
        bad = {t: v for t, v in bias.items() if not _is_real(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
        if bad:
            raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {bad!r}")
        self.logit_bias = {int(t): float(v) for t, v in bias.items()}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if self.grammar is not None and not isinstance(self.grammar, JsonGrammar):
            raise ValueError(f"grammar must be a JsonGrammar or None, got {self.grammar!r}")
        if self.grammar is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("a JSON grammar ends the output when the JSON is complete, so it cannot be combined with "
                             "ignore_eos or min_tokens")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def has_processors(self) -> bool:
        """Whether any logit processor changes this request's target logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
