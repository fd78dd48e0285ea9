"""Prometheus metrics for ``GET /metrics``, named like vLLM's (``vllm:`` -> ``saguaro:``).

All values are updated on the engine thread as rounds complete (counters grow per round, not
per finished request), except the two queue gauges and the KV usage, which are read when
scraped. Each app gets its own ``CollectorRegistry``, so several servers can share a process.

  saguaro:num_requests_running / _waiting    requests prefilling or decoding / queued (not yet admitted)
  saguaro:kv_cache_usage_perc                 fraction of the target's KV blocks in use
  saguaro:prompt_tokens_total                 prompt tokens of requests that got their first token
  saguaro:generation_tokens_total             tokens generated
  saguaro:request_success_total{finished_reason}   finished requests: stop, length, abort, error
  saguaro:time_to_first_token_seconds         submission to first token (histogram)
  saguaro:time_per_output_token_seconds       per request, (finish - first token) / (tokens - 1)
  saguaro:e2e_request_latency_seconds         submission to finish (histogram)
SD and SSD add the speculation counters (rounds are "drafts", as in vLLM):
  saguaro:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
  saguaro:spec_decode_num_draft_tokens_per_pos_total{position} and
  saguaro:spec_decode_num_accepted_tokens_per_pos_total{position}: acceptance at depth i is their ratio;
and SSD the speculation cache: saguaro:ssd_cache_hits_total, saguaro:ssd_cache_misses_total.
Per-request adaptive K (saguaro.adapt): saguaro:spec_decode_k (histogram of the K chosen per round),
saguaro:spec_decode_rounds_at_k0_total (rounds a request ran as AR) and
saguaro:spec_decode_acceptance_estimate{position} (the running requests' mean estimate, read when scraped);
SSD adds saguaro:ssd_build_fan_out (histogram of the branches each round's build was asked to prepare for a
request: in the cache tree chosen for the round, the fan-outs of a speculation of the request's K, its guesses
at depths 0..K - 1 and the all-accepted one's).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from saguaro.engine.llm_engine import LLMEngine
from saguaro.engine.sequence import Sequence

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


@dataclass
class RequestCounts:
    """What has already been counted for one live request (the metrics add only the difference)."""
    submitted: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    cache_hits: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    k_rounds: int = 0  # entries of seq.spec.k_per_round counted
    fan_out_rounds: int = 0  # entries of seq.spec.fan_out_per_round counted


class ServerMetrics:
    def __init__(self, engine: LLMEngine, queued: Callable[[], int] = lambda: 0):
        self.registry = r = CollectorRegistry()
        blocks = engine.target.blocks
        Gauge("saguaro:num_requests_running", "Requests being prefilled or decoded.", registry=r).set_function(
            lambda: len(engine.scheduler.running) + len(engine.scheduler.prefilling))
        Gauge("saguaro:num_requests_waiting", "Requests waiting to be admitted.", registry=r).set_function(
            lambda: len(engine.scheduler.waiting) + queued())
        Gauge("saguaro:kv_cache_usage_perc", "Fraction of the target's KV cache blocks in use (0 to 1).",
              registry=r).set_function(lambda: 1 - blocks.num_free / blocks.num_blocks)
        self.prompt_tokens = Counter("saguaro:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("saguaro:generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("saguaro:request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.ttft = Histogram("saguaro:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("saguaro:time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("saguaro:e2e_request_latency_seconds", "Submission to finish.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.spec = engine.decoder.reports_spec
        self.cache = engine.decoder.reports_cache
        if self.spec:
            self.drafts = Counter("saguaro:spec_decode_num_drafts", "Speculative rounds.", registry=r)
            self.draft_tokens = Counter("saguaro:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
            self.accepted = Counter("saguaro:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
            self.draft_by_pos = Counter("saguaro:spec_decode_num_draft_tokens_per_pos",
                                        "Draft tokens proposed at each depth.", ["position"], registry=r)
            self.chosen_k = Histogram("saguaro:spec_decode_k", "K chosen per round (0: an AR step).",
                                      buckets=tuple(range(17)), registry=r)
            self.rounds_at_k0 = Counter("saguaro:spec_decode_rounds_at_k0", "Rounds run at K = 0.", registry=r)
            _EstimateGauge(engine, r)
            self.accepted_by_pos = Counter("saguaro:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each depth.", ["position"], registry=r)
        if self.cache:
            self.hits = Counter("saguaro:ssd_cache_hits", "SSD rounds whose speculation was in the cache.", registry=r)
            self.misses = Counter("saguaro:ssd_cache_misses", "SSD rounds that fell back (cache miss).", registry=r)
            self.fan_out = Histogram("saguaro:ssd_build_fan_out", "Branches asked of a round's build per request.",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_tokens(self, seq: Sequence, counts: RequestCounts) -> None:
        """Count what ``seq`` gained since ``counts`` (tokens, speculation); call after every round it took part in."""
        gained = len(seq.output_ids) - counts.tokens
        if gained > 0:
            if counts.tokens == 0:
                self.prompt_tokens.inc(len(seq.prompt_ids))
                self.ttft.observe(time.perf_counter() - counts.submitted)
            self.generation_tokens.inc(gained)
            counts.tokens = len(seq.output_ids)
        if self.spec:
            self._count_spec(seq, counts)

    def _count_spec(self, seq: Sequence, counts: RequestCounts) -> None:
        s = seq.spec
        for k in s.k_per_round[counts.k_rounds:]:
            self.chosen_k.observe(k)
            self.rounds_at_k0.inc(k == 0)
        counts.k_rounds = len(s.k_per_round)
        self.drafts.inc(s.rounds - counts.rounds)
        self.draft_tokens.inc(s.drafted - counts.drafted)
        self.accepted.inc(s.accepted - counts.accepted)
        if self.cache:
            for f in s.fan_out_per_round[counts.fan_out_rounds:]:
                if f:  # a round at K = 0 asks no build
                    self.fan_out.observe(f)
            counts.fan_out_rounds = len(s.fan_out_per_round)
            hits = s.cache_hits - counts.cache_hits
            self.hits.inc(hits)
            self.misses.inc(s.rounds - counts.rounds - hits)
        for i, (d, a) in enumerate(zip(s.drafted_by_position, s.accepted_by_position)):
            old_d = counts.drafted_by_position[i] if i < len(counts.drafted_by_position) else 0
            old_a = counts.accepted_by_position[i] if i < len(counts.accepted_by_position) else 0
            if d > old_d:
                self.draft_by_pos.labels(position=str(i)).inc(d - old_d)
            if a > old_a:
                self.accepted_by_pos.labels(position=str(i)).inc(a - old_a)
        counts.rounds, counts.drafted, counts.accepted = s.rounds, s.drafted, s.accepted
        counts.cache_hits = s.cache_hits
        counts.drafted_by_position = list(s.drafted_by_position)
        counts.accepted_by_position = list(s.accepted_by_position)

    def on_finish(self, seq: Sequence, counts: RequestCounts) -> None:
        self.on_tokens(seq, counts)
        now = time.perf_counter()
        reason = seq.finish_reason or "abort"
        self.finished.labels(finished_reason="error" if reason.startswith("error") else reason).inc()  # no messages
        self.e2e.observe(now - counts.submitted)
        n = len(seq.output_ids)
        if n > 1 and seq.first_token_time is not None:
            self.tpot.observe(((seq.finish_time or now) - seq.first_token_time) / (n - 1))


class _EstimateGauge:
    """saguaro:spec_decode_acceptance_estimate{position}: the mean over running requests of their adaptive
    acceptance estimate, collected when scraped."""

    def __init__(self, engine: LLMEngine, registry: CollectorRegistry):
        self.engine = engine
        registry.register(self)

    def collect(self):
        family = GaugeMetricFamily("saguaro:spec_decode_acceptance_estimate",
                                   "Running requests' mean adaptive acceptance estimate by draft position.",
                                   labels=["position"])
        rates = [s.spec.acceptance_estimate for s in self.engine.scheduler.running if s.spec.acceptance_estimate]
        for i in range(max((len(r) for r in rates), default=0)):
            at = [r[i] for r in rates if i < len(r)]
            family.add_metric([str(i)], sum(at) / len(at))
        yield family
