"""Turn per-request speculation counters into reported metrics."""
from __future__ import annotations

from saguaro.engine.outputs import SpeculationMetrics
from saguaro.engine.sequence import SpeculationCounts


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(stats: list[SpeculationCounts], with_cache: bool = False) -> SpeculationMetrics:
    """Sum counters over requests, then form rates (so long requests weigh more)."""
    total = SpeculationCounts()
    for s in stats:
        total.rounds += s.rounds
        total.drafted += s.drafted
        total.accepted += s.accepted
        for name in ("cache_hits", "hits_after_hit", "rounds_after_hit", "hits_after_miss", "rounds_after_miss"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        depth = len(s.drafted_by_position)
        if depth > len(total.drafted_by_position):
            pad = depth - len(total.drafted_by_position)
            total.drafted_by_position += [0] * pad
            total.accepted_by_position += [0] * pad
        for i in range(depth):
            total.drafted_by_position[i] += s.drafted_by_position[i]
            total.accepted_by_position[i] += s.accepted_by_position[i]
    metrics = SpeculationMetrics(
        rounds=total.rounds,
        drafted_tokens=total.drafted,
        accepted_tokens=total.accepted,
        acceptance_rate=_ratio(total.accepted, total.drafted) or 0.0,
        mean_accepted_length=_ratio(total.accepted, total.rounds) or 0.0,
        tokens_per_round=_ratio(total.accepted + total.rounds, total.rounds) or 0.0,
        acceptance_by_position=[a / d if d else 0.0 for a, d in
                                zip(total.accepted_by_position, total.drafted_by_position)],
    )
    chosen = [k for s in stats for k in s.k_per_round]
    metrics.rounds_at_k0 = sum(s.rounds_at_k0 for s in stats)
    metrics.mean_k = _ratio(sum(chosen), len(chosen)) or 0.0
    built = [f for s in stats for f in s.fan_out_per_round if f]
    metrics.mean_fan_out = _ratio(sum(built), len(built)) or 0.0
    if len(stats) == 1:  # one request's schedule and estimate (summed over several they mean nothing)
        metrics.k_per_round = list(stats[0].k_per_round)
        metrics.acceptance_estimate = list(stats[0].acceptance_estimate)
        metrics.fan_out_per_round = list(stats[0].fan_out_per_round)
        metrics.gain_per_round = list(stats[0].gain_per_round)
    if with_cache:
        metrics.cache_hit_rate = _ratio(total.cache_hits, total.rounds)
        metrics.hit_rate_after_hit = _ratio(total.hits_after_hit, total.rounds_after_hit)
        metrics.hit_rate_after_miss = _ratio(total.hits_after_miss, total.rounds_after_miss)
    return metrics
