"""What adaptation shows: ``out.spec`` (K per round, rounds at K = 0, the estimate) and ``/metrics``."""
import pytest

generate_latest = pytest.importorskip("prometheus_client").generate_latest  # absent on the GPU machine

import numpy as np  # noqa: E402

from saguaro import LLM, SamplingParams  # noqa: E402
from saguaro.adapt.tree_choice import branches_at  # noqa: E402
from saguaro.adapt_settings import TREE_OPTIONS, AdaptSettings  # noqa: E402
from saguaro.server.metrics import RequestCounts, ServerMetrics  # noqa: E402
from tests.tiny import PROMPTS, weak_pair  # noqa: E402

MOVING = AdaptSettings(prior=0.9, probe_interval=1, max_probe_interval=2, probe_budget=1.0, trees_without_profile=True,
                       **TREE_OPTIONS)


def _value(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_out_spec_and_metrics_report_the_schedule():
    target, draft = weak_pair()
    llm = LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=3, block_size=4, adapt=MOVING)
    metrics = ServerMetrics(llm.engine)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in PROMPTS]
    counts = {s.seq_id: RequestCounts() for s in seqs}
    scraped = ""
    while engine.has_unfinished:
        for seq, _ in engine.step():
            metrics.on_tokens(seq, counts[seq.seq_id])
        if any(s.spec.acceptance_estimate for s in engine.scheduler.running):
            scraped = scraped or generate_latest(metrics.registry).decode()
    assert 'saguaro:spec_decode_acceptance_estimate{position="0"}' in scraped  # read while requests run
    outs = [engine.output(s) for s in seqs]
    for out in outs:
        spec = out.spec
        assert spec.k_per_round == out.spec_counts.k_per_round
        assert spec.rounds_at_k0 == spec.k_per_round.count(0)
        assert spec.rounds == len(spec.k_per_round) - spec.rounds_at_k0  # K = 0 rounds are AR steps
        assert len(spec.acceptance_estimate) == 3 and all(0 <= a <= 1 for a in spec.acceptance_estimate)
    total = llm.spec_metrics(outs)
    chosen = [k for o in outs for k in o.spec.k_per_round]
    assert total.rounds_at_k0 == chosen.count(0) > 0 and total.mean_k == sum(chosen) / len(chosen)
    assert total.k_per_round == []  # one request's schedule only
    text = generate_latest(metrics.registry).decode()
    assert _value(text, "saguaro:spec_decode_k_count") == len(chosen)
    assert _value(text, "saguaro:spec_decode_rounds_at_k0_total") == chosen.count(0)
    assert 'saguaro:spec_decode_k_bucket{le="0.0"} ' + f"{float(chosen.count(0))}" in text


def test_ssd_reports_the_fan_out_chosen_per_round():
    target, draft = weak_pair()
    with LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=3, block_size=4, adapt=MOVING,
             speculator_transport="thread") as llm:
        metrics = ServerMetrics(llm.engine)
        engine = llm.engine
        seqs = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in PROMPTS]
        counts = {s.seq_id: RequestCounts() for s in seqs}
        while engine.has_unfinished:
            for seq, _ in engine.step():
                metrics.on_tokens(seq, counts[seq.seq_id])
        outs = [engine.output(s) for s in seqs]
        plan = engine.decoder.plan
    built = []
    for out in outs:
        spec = out.spec
        assert len(spec.fan_out_per_round) == len(spec.k_per_round)
        assert all((f > 0) == (k > 0) for f, k in zip(spec.fan_out_per_round, spec.k_per_round))
        # a K-draft speculation's branches in one of the plan's trees: its guesses at depths 0..K - 1 and F_K's
        at_k = [{int(branches_at(np.array([f]))[0][k]) for f in plan.lists()} for k in range(4)]
        assert all(f in at_k[k] for f, k in zip(spec.fan_out_per_round, spec.k_per_round) if k)
        built += [f for f in spec.fan_out_per_round if f]
    assert built and llm.spec_metrics(outs).mean_fan_out == pytest.approx(sum(built) / len(built))
    text = generate_latest(metrics.registry).decode()
    assert _value(text, "saguaro:ssd_build_fan_out_count") == len(built)
    assert _value(text, "saguaro:ssd_build_fan_out_sum") == sum(built)
