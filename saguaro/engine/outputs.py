"""What the engine hands back for each request."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Timings:
    ttft_s: float  # arrival to first generated token
    total_s: float  # arrival to finish
    decode_tokens_per_s: float  # tokens after the first, over the time after the first


@dataclass
class SpeculationMetrics:
    """Speculation counters of one request, or summed over many."""
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    mean_accepted_length: float = 0.0  # accepted drafts per round (excludes the bonus token)
    tokens_per_round: float = 0.0  # accepted + bonus per round
    acceptance_by_position: list[float] = field(default_factory=list)
    cache_hit_rate: float | None = None  # SSD: p_hit
    hit_rate_after_hit: float | None = None  # SSD: p_hit,p
    hit_rate_after_miss: float | None = None  # SSD: p_hit,b
    # per-request adaptive K (saguaro.adapt): the K chosen each round (one request's; [] summed over several),
    # the rounds at K = 0 (AR steps), the mean K, and the acceptance estimate by position after the last round
    k_per_round: list[int] = field(default_factory=list)
    rounds_at_k0: int = 0
    mean_k: float = 0.0
    acceptance_estimate: list[float] = field(default_factory=list)
    # SSD, adaptive: the branches each round's build was asked to prepare for the request (in the round's cache tree,
    # its guesses at depths 0..K - 1 and the all-accepted one's; 0 at K = 0), one request's, and their mean over the
    # speculating rounds
    fan_out_per_round: list[int] = field(default_factory=list)
    mean_fan_out: float = 0.0
    # adaptive: the speedup over AR the chooser predicted for the K it chose each round (one request's), which
    # ``bench adapt`` sets beside what each round gave
    gain_per_round: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or string), "length", "abort", or "error: <why>"
    timings: Timings
    spec: SpeculationMetrics | None = None
    spec_counts: Any = field(default=None, repr=False)  # raw SpeculationCounts, summed by LLM.spec_metrics
    logprobs: list[Any] | None = None  # per output token a TokenLogprob (saguaro.sampling.logprobs), if asked
    prompt_logprobs: list[Any] | None = None  # per prompt token, None for the first, if asked

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("spec_counts")
        return d


@dataclass
class StreamChunk:
    request_id: int
    token_ids: list[int]  # tokens added since the previous chunk
    text: str  # text added since the previous chunk
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None  # set on the final chunk
    logprobs: list[Any] | None = None  # the TokenLogprobs of ``token_ids``, when the request asked for them
    prompt_logprobs: list[Any] | None = None  # on a request's first chunk, when it asked for them
