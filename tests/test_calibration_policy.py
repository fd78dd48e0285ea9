"""fan_out / saguaro_c / miss_strategy / K = "auto": choices from a profile (Thm 12, 13, 18) and their wiring."""
import logging
import math
from dataclasses import replace

import numpy as np
import pytest

from saguaro import LLM, SamplingParams
from saguaro.calibration import default_profile, save_profile
from saguaro.calibration.profile import BusyDraft, ContentionProbe, Profile, Source, StepOverhead
from saguaro.calibration.hits import (deep_share, depth_weights_for, expected_round_tokens, fan_out_for_budget,
                                      hit_rate, verified_mix)
from saguaro.calibration.policy import (best_choice, critical_batch, evaluate, make_plan,
                                        recommended_k, tree_shapes)
from saguaro.calibration.timeline import build_time, rows_time
from saguaro.engine.model_runner import ModelRunner
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest
from saguaro.ssd_settings import SSDSettings
from saguaro.ssd.speculator import Speculator
from saguaro.theory import critical_batch_size, integer_geometric_fanout, optimal_fanout
from tests.tiny import tiny_model, truncated

VOCAB = 151936


def _empirical(profile: Profile) -> Profile:
    """Replace the power-law curves with a saturating, non-power-law curve (forces Thm 13)."""
    f = np.arange(65)
    curve = np.where(f > 0, 0.9 - 0.5 * 0.5 ** f, 0.0)
    for entry in profile.temperatures.values():
        for source in ("primary", "backup"):
            s = getattr(entry, source)
            s.hit_curves, s.power_law, s.r2 = [curve.tolist()] * len(s.hit_curves), False, 0.3
    return profile


def test_rows_time_interpolates_and_extrapolates():
    table = {"1": 1.0, "4": 1.3, "8": 2.1}
    assert rows_time(table, 1) == 1.0 and rows_time(table, 2) == pytest.approx(1.1)
    assert rows_time(table, 16) == pytest.approx(2.1 + 0.2 * 8)


def test_depth_weights_from_the_measured_outcome_law():
    source = Source(acceptance=0.5, outcome_pmf=[0.2, 0.1, 0.1, 0.6])
    assert depth_weights_for(source, 3) == pytest.approx([0.2, 0.1, 0.1, 0.6])
    assert depth_weights_for(source, 1) == pytest.approx([0.2, 0.8])  # all of the first token accepted: 0.8
    assert depth_weights_for(source, 5) == pytest.approx([0.2, 0.1, 0.1, 0.3, 0.15, 0.15])  # geometric past K
    assert expected_round_tokens(source, 3) == pytest.approx(0.2 + 0.2 + 0.3 + 2.4)
    assert depth_weights_for(Source(acceptance=0.5), 2) == pytest.approx([0.5, 0.25, 0.25])  # no measurement: Thm 2


def test_geometric_when_the_power_law_fits():
    source = default_profile("a", "b", "bf16", 4).temperatures["1.0"].primary
    f, method = fan_out_for_budget(source, 4, 4, 24, VOCAB)
    assert method == "thm12-geometric" and sum(f) == 24
    assert f == integer_geometric_fanout(source.acceptance, source.r, 4, 24, max_fanout=[64] * 5).tolist()
    f, _ = fan_out_for_budget(source, 2, 4, 10, VOCAB)  # speculations of 2 tokens: depths 0, 1 and "all" at K
    assert f[2:4] == [0, 0] and sum(f) == 10


def test_empirical_curves_use_thm13():
    source = _empirical(default_profile("a", "b", "bf16", 3)).temperatures["1.0"].primary
    f, method = fan_out_for_budget(source, 3, 3, 9, VOCAB)
    curves = [np.asarray(c) for c in source.hit_curves]
    assert method == "thm13-empirical" and f == optimal_fanout(curves, 9, a=source.acceptance).tolist()


def test_budget_choice_is_the_best_prediction():
    profile = default_profile("a", "b", "bf16", 4)
    entry = profile.temperatures["0.0"]
    best = best_choice(profile, entry, 4, 1, "jit", VOCAB)
    for budget in (1, 4, 16, 64):
        assert evaluate(profile, entry, 4, 1, budget, "jit", VOCAB).speedup <= best.speedup + 1e-12
    assert best.steps >= 1 and sum(best.primary) <= best.budget


def _cpu_like_timing(profile: Profile) -> Profile:
    """Timings shaped like the Qwen pair on one core: a 1-row draft step is a tenth of a verification, a
    5-row step a fifth, so a full K = 5 tree of 6 branches cannot finish during one verification."""
    profile.timing.target_rows = {"1": 0.100, "6": 0.115}
    profile.timing.draft_rows = {"1": 0.011, "5": 0.024, "16": 0.07}
    profile.timing.contention = None
    return profile


def test_tapered_build_time_and_deep_share():
    timing = _cpu_like_timing(default_profile("a", "b", "bf16", 5)).timing
    full = build_time(timing, 5, 1, 6)  # 6 branches: a 1-row glue, then 6-row steps
    assert full.steps == full.deep_steps < 5  # the full tree is cut short
    tapered = build_time(timing, 5, 1, 6, branch_steps=2)
    assert tapered.steps == 2 and full.steps < tapered.deep_steps <= 5
    source = Source(acceptance=0.8, hit_curves=[[0, 0.5, 0.7, 0.8]] * 3)
    share = deep_share(source, [1, 1, 2], 2, 1)
    w = depth_weights_for(source, 2)  # (depth, rank) scores: w0 .5, w1 .5, w2 .5, w2 .2
    assert share == pytest.approx(0.5 * w[2] / (0.5 * w[0] + 0.5 * w[1] + 0.7 * w[2]))
    assert deep_share(source, [1, 1, 2], 2, 4) == pytest.approx(1.0)


def test_taper_is_chosen_when_it_predicts_faster():
    profile = _cpu_like_timing(default_profile("a", "b", "bf16", 5))
    entry = profile.temperatures["0.0"]
    plain = best_choice(profile, entry, 5, 1, "jit", VOCAB)
    tapered = best_choice(profile, entry, 5, 1, "jit", VOCAB, tree_shapes(5, True))
    assert tapered.tok_s >= plain.tok_s
    assert tapered.branch_steps is not None and tapered.deep_steps > tapered.steps and 0 < tapered.deep_share <= 1
    plan = make_plan(profile, 5, SSDSettings(fan_out="auto", branch_steps="auto"), 2, VOCAB).plan
    assert plan.branch_steps[0] == tapered.branch_steps and len(plan.branch_steps) == len(plan.temperatures)
    assert plan.branch_widths(7, 0.0) == [7] * tapered.branch_steps + [1] * (5 - tapered.branch_steps)
    full = make_plan(profile, 5, SSDSettings(fan_out="auto"), 2, VOCAB).plan
    assert full.branch_steps == [None] * len(plan.temperatures)
    wide = make_plan(profile, 5, SSDSettings(fan_out="auto", branch_steps="auto", deep_branches=2), 1, VOCAB).plan
    # the deep count reaches the plan
    assert wide.deep_branches == 2
    source, f = entry.primary, tapered.primary
    assert deep_share(source, f, tapered.steps, 2) >= deep_share(source, f, tapered.steps, 1)


def test_critical_batch_size_is_thm18_on_the_measured_inputs():
    profile = default_profile("a", "b", "bf16", 4)
    profile.timing.ngram_s = 0.001
    for t in profile.temperatures.values():
        t.backup.tokens_per_round = 1.3
    b_star, args = critical_batch(profile, "0.0", 4, VOCAB)
    try:
        want = critical_batch_size(**args)
    except ValueError:
        want = None
    assert want is None or math.isclose(b_star, want)


def test_b_star_is_judged_with_the_fan_outs_the_plan_uses():
    """Given fan-outs, Thm 18 compares the options with them (the p_hit and E_hit they give), not with each
    option's best: the plan's threshold is then the one its caches make, and no per-batch search runs."""
    profile = default_profile("a", "b", "bf16", 4)
    for t in profile.temperatures.values():
        t.backup.tokens_per_round = 1.3
    given = [1, 1, 1, 1, 1]
    _, best = critical_batch(profile, "0.0", 4, VOCAB)
    _, ones = critical_batch(profile, "0.0", 4, VOCAB, fan_out=given)
    assert ones["p_hit"] < best["p_hit"]
    plan = make_plan(profile, 4, SSDSettings(fan_out=given, miss_strategy="auto"), 64, VOCAB).plan
    b_star, _ = critical_batch(profile, "0.0", 4, VOCAB, fan_out=given)
    assert plan.b_star == b_star and plan.primary == [[given]] * 2


def test_auto_misses_are_jit_where_the_build_replays_a_graph():
    """A backup's speculation sends a graph build back to Python: "auto" is jit for a GPU draft on its fast path,
    Thm 18's choice on the CPU (the default settings)."""
    from types import SimpleNamespace

    from saguaro.calibration.resolve import _graph_builds
    assert SSDSettings().miss_strategy == "auto"
    gpu = SimpleNamespace(device="cuda:0", draft_device="cuda:1", enforce_eager=False)
    assert _graph_builds(gpu)
    assert not _graph_builds(SimpleNamespace(device="cuda:0", draft_device="cuda:1", enforce_eager=True))
    assert not _graph_builds(SimpleNamespace(device="cuda:0", draft_device="cpu", enforce_eager=False))
    assert not _graph_builds(SimpleNamespace(device="cpu", draft_device=None, enforce_eager=False))


def test_plan_tables_and_c():
    profile = default_profile("a", "b", "bf16", 2)
    sweep = replace(profile.temperatures["1.0"].primary, c=0.5, acceptance=0.74)
    profile.temperatures["1.0"] = replace(profile.temperatures["1.0"], c_sweep=[sweep])
    chosen = make_plan(profile, 2, SSDSettings(fan_out="auto", miss_strategy="auto", saguaro_c="auto"), 4, VOCAB)
    plan = chosen.plan
    assert plan.temperatures == [0.0, 1.0] and plan.c[0] == 1.0 and plan.c[1] in (1.0, 0.5)
    assert all(len(t) == 4 for t in plan.primary + plan.backup)
    assert chosen.report.b_star == plan.b_star
    fixed = make_plan(profile, 2, SSDSettings(fan_out="auto", saguaro_c=0.3, miss_strategy="jit"), 2, VOCAB).plan
    assert fixed.c == [0.3, 0.3] and fixed.b_star == math.inf
    assert 1 <= recommended_k(profile) <= 8


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    return target, truncated(target, 1)


def test_auto_miss_strategy_switches_with_batch_size_and_uses_backup_fan_out(pair, caplog):
    plan = SpecPlan(2, [0.0], [[[1, 1, 1]]], [[[0, 0, 3]]], [1.0], "auto", b_star=2.5)
    spec = Speculator(ModelRunner(pair[1].model, 512, 4), plan)
    greedy = SamplingParams()
    adm = [Admission(i, [3, 7, 1 + i], greedy, 0) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="saguaro.ssd"):
        rows = spec.respond(RoundRequest([], adm[:2], [], [0, 1])).rows  # batch 2 < b*: just in time
        assert not any(r.point_mass for r in rows) and spec.miss_strategy == "jit"
        spec.build()
        outs = [Outcome(i, 0, 63) for i in range(2)]  # unlikely outcomes: misses
        rows = spec.respond(RoundRequest(outs, adm[2:], [], [0, 1, 2])).rows  # batch 3 >= b*: n-gram
        assert all(r.point_mass for r in rows) and spec.miss_strategy == "ngram"
        spec.build()
        keys = spec.cache.keys()
        assert keys and all(k == len(spec.states[seq].sent) for seq, k, _ in keys)  # F^b: only the all-accepted depth
        outs = [Outcome(i, 0, 63) for i in range(2)]
        rows = spec.respond(RoundRequest(outs, [], [2], [0, 1])).rows  # back to batch 2
        assert spec.miss_strategy == "jit" and not any(r.point_mass for r in rows)
    assert spec.miss_strategy_switches == [(3, "ngram"), (2, "jit")]
    assert sum("miss strategy jit -> ngram" in r.message for r in caplog.records) == 1
    spec.close()


PROMPTS = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7]]


def test_engine_auto_settings_with_and_without_a_profile(pair, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    with LLM(pair[0], block_size=4) as ar:
        want = [o.token_ids for o in ar.generate(PROMPTS, SamplingParams(max_tokens=16))]
    opts = dict(mode="ssd", fan_out="auto", miss_strategy="auto", saguaro_c="auto", block_size=4, max_num_seqs=4)
    with caplog.at_level(logging.INFO):
        with LLM(target=pair[0], draft=pair[1], num_speculative_tokens=3, **opts) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))] == want
            plan = llm.engine.decoder.plan
    assert any("no calibration profile" in r.message for r in caplog.records)
    assert len(plan.primary[0]) == 4 and plan.k == 3
    profile = _empirical(default_profile(pair[0].name, pair[1].name, "float32", 3))
    profile.default = False
    save_profile(profile)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        with LLM(target=pair[0], draft=pair[1], num_speculative_tokens="auto", **opts) as llm:
            out = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
            plan = llm.engine.decoder.plan
            k = llm.config.num_speculative_tokens
    assert [o.token_ids for o in out] == want
    assert not any("no calibration profile" in r.message for r in caplog.records)
    assert isinstance(k, int) and plan.k == k
    settings = SSDSettings(fan_out="auto", miss_strategy="auto", saguaro_c="auto")
    report = make_plan(profile, k, settings, 4, pair[0].config.vocab_size).report
    assert not report.default_profile and report.temperatures["0.0"].choice.method == "thm13-empirical"


def test_the_default_auto_misses_are_jit_without_a_calibration(pair, tmp_path, monkeypatch):
    """The defaults' hit model cannot judge a tree of single guesses (it predicts no hit), so an uncalibrated
    pair keeps jit; a calibrated one follows its b* (``test_engine_auto_miss_strategy_switches_at_b_star``)."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, block_size=4) as llm:
        assert llm.config.ssd.miss_strategy == "auto" and llm.engine.decoder.plan.miss_strategy == "jit"


def test_engine_auto_miss_strategy_switches_at_b_star(pair, tmp_path, monkeypatch, caplog):
    """A profile whose Thm 18 threshold is b* = 2.5: batches of 3 use the n-gram backup, smaller ones jit."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    profile = default_profile(pair[0].name, pair[1].name, "float32", 3)
    profile.default = False
    for n in profile.timing.draft_rows:
        profile.timing.draft_rows[n] *= 0.1 / 0.38
    for entry in profile.temperatures.values():
        entry.backup = replace(entry.backup, tokens_per_round=1.2)
    save_profile(profile)
    with LLM(pair[0], block_size=4) as ar:
        want = [o.token_ids for o in ar.generate(PROMPTS, SamplingParams(max_tokens=16))]
    with caplog.at_level(logging.INFO, logger="saguaro.ssd"):
        with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, miss_strategy="auto",
                 fan_out="auto", block_size=4, max_num_seqs=4) as llm:  # b* with each option's best fan-outs
            first = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16))[0]
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
            decoder = llm.engine.decoder
    assert decoder.plan.b_star == pytest.approx(2.5, abs=0.1)
    assert first.token_ids == want[0] and [o.token_ids for o in outs] == want
    assert {t.miss_strategy for t in decoder.trace} == {"jit", "ngram"}
    assert decoder.miss_strategy_switches[0] == (3, "ngram")
    assert any("miss strategy jit -> ngram" in r.message for r in caplog.records)


def test_verified_mix_follows_the_lengths_of_the_verified_speculations():
    """p_hit over the chain of verified lengths: a full tree that finishes is always K long; a tree cut
    short at L alternates with the K-token speculations of misses; a tapered tree whose every hit is deep
    verifies only K-token speculations, however short its shallow branches."""
    curve = [0.0] + [1 - 0.4 * F ** -0.7 for F in range(1, 65)]  # p_hit^d(F), the same at every depth
    src = Source(acceptance=0.8, hit_curves=[curve] * 5)  # capped geometric outcome law
    f = [1, 1, 1, 1, 2]
    h2, h4 = hit_rate(src, f, 2), hit_rate(src, f, 4)
    assert h2 > h4  # a short speculation's all-accepted outcome is likelier
    assert verified_mix(src, f, 4, 4, 4, 1) == pytest.approx((h4, 0.0))
    pi2 = h4 / (1 - h2 + h4)  # stationary share of 2-token speculations (hits -> 2, misses -> 4)
    assert verified_mix(src, f, 2, 2, 4, 1)[0] == pytest.approx(pi2 * h2 + (1 - pi2) * h4)
    assert verified_mix(src, f, 2, 4, 4, 99) == pytest.approx((h4, 1.0))  # every branch deep
    p, share = verified_mix(src, f, 2, 4, 4, 1)
    assert h4 < p < h2 and share == pytest.approx(deep_share(src, f, 4, 1), abs=0.2)


def test_step_overhead_lengthens_builds_but_not_verifications():
    """A step's logits work (distributions, draw, ranked ids) runs on the draft's core without streaming
    weights: the build takes longer and finishes fewer steps, the verification is no slower."""
    timing = _cpu_like_timing(default_profile("a", "b", "bf16", 5)).timing
    timing.contention = ContentionProbe(busy=[BusyDraft(draft_rows=1, slowdown=1.5, draft_passes_per_s=1 / 0.0165),
                                              BusyDraft(draft_rows=16, slowdown=1.2, draft_passes_per_s=1 / 0.084)])
    plain = build_time(timing, 5, 1, 6, 2)
    timing.step_overhead = StepOverhead(greedy={"1": 0.0, "16": 0.0}, sampled={"1": 0.012, "16": 0.012})
    assert build_time(timing, 5, 1, 6, 2) == plain
    slow = build_time(timing, 5, 1, 6, 2, sampled=True)
    assert slow.deep_steps < plain.deep_steps and slow.t_v < plain.t_v
    assert slow.t_v >= timing.target_rows["6"]  # never faster than the verification alone


def test_a_pair_that_always_hits_plans_without_error():
    """A profile whose hit curves are 1 at every depth (greedy code on the real pair): the weighted mix of
    the per-depth rates can land an ulp above 1, and the plan must still come out, with every p_hit <= 1."""
    profile = default_profile("a", "b", "bf16", 4)
    for entry in profile.temperatures.values():
        for source in ("primary", "backup"):
            s = getattr(entry, source)
            s.hit_curves, s.power_law = [[0.0] + [1.0] * 64] * len(s.hit_curves), False
    make_plan(profile, 4, SSDSettings(fan_out="auto", miss_strategy="auto", saguaro_c="auto"), 8, VOCAB)
    for entry in profile.temperatures.values():
        for batch, strategy in ((1, "jit"), (8, "ngram")):
            assert 0.0 <= best_choice(profile, entry, 4, batch, strategy, VOCAB).p_hit <= 1.0
