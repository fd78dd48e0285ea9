"""One request as the engine tracks it."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from saguaro.sampling.params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpeculationCounts:
    """Per-request speculation counters (all zero in AR mode)."""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at depth i
    drafted_by_position: list[int] = field(default_factory=list)  # [i]: drafts proposed at depth i
    cache_hits: int = 0  # SSD only
    hits_after_hit: int = 0
    rounds_after_hit: int = 0
    hits_after_miss: int = 0
    rounds_after_miss: int = 0
    k_per_round: list[int] = field(default_factory=list)  # the K chosen for each round (saguaro.adapt)
    rounds_at_k0: int = 0  # rounds chosen at K = 0: AR steps, in none of the counters above
    acceptance_estimate: list[float] = field(default_factory=list)  # the adaptive estimate's a_j, last round
    fan_out_per_round: list[int] = field(default_factory=list)  # SSD, adaptive: branches asked of each round's build
    gain_per_round: list[float] = field(default_factory=list)  # adaptive: the speedup predicted for each K chosen

    def chose(self, k: int) -> None:
        self.k_per_round.append(k)
        self.rounds_at_k0 += k == 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if self.k_per_round and self.k_per_round[-1] == 0:
            return  # a round chosen at K = 0 is an AR step: counted in rounds_at_k0 only
        self.rounds += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        grow = num_drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < num_accepted)


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None):
        if not prompt_ids:
            raise ValueError("prompt is empty")
        self.seq_id = next(_ids)
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.end_ids: list[int] = list(params.stop_token_ids)  # what min_tokens holds back; the engine adds EOS
        self.generator: torch.Generator | None = None
        self.grammar: Any = None  # a sampling.grammar.GrammarState when params.grammar is set (the engine makes it)
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is None:
                self.generator.seed()  # nondeterministic
            else:
                self.generator.manual_seed(params.seed)
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_cached = 0  # tokens whose k/v sit in the target cache
        self.finish_reason: str | None = None
        self.stop_text_cut: int | None = None  # char offset where a stop string began
        self.stop_text: Any = None  # the engine's IncrementalDetokenizer over output_ids, when stop strings are set
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.spec = SpeculationCounts()
        self.pending_logprobs: list[Any] | None = None  # this round's TokenLogprobs, taken as its tokens are appended
        self.output_logprobs: list[Any] = []  # one TokenLogprob per output token, when params.logprobs is set
        self.prompt_logprobs: list[Any] = []  # None, then one per prompt token after the first (prompt_logprobs)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_end(self) -> int:
        """Tokens the target caches by the end of prefill: all of a fresh prompt (its last logits give the first
        token), all but the last of a resumed request (the next round feeds it)."""
        return len(self) if not self.output_ids else len(self) - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
