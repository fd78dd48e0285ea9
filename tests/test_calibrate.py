"""Calibration: bonus-token ranks predict cache hits exactly, the profile's contents, and its storage."""
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from saguaro import SamplingParams
from saguaro.calibration import default_profile, load_profile, profile_path, save_profile
from saguaro.calibration.measure import calibrate, run_ranked, summarize_source
from saguaro.calibration.profile import BusyDraft, ContentionProbe
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.ranks import RankRecorder
from tests.tiny import perturbed, tiny_model

PROMPTS = [[3, 7, 1], [5, 9, 13, 17, 21], [2, 2, 8, 40, 11], [60, 1, 5, 30]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=3, vocab=64, layers=2, sharpness=2.5)
    return target, perturbed(target, noise=0.15)


def test_rank_excludes_the_drafted_token():
    rec = RankRecorder()
    rec.remember(0, torch.tensor([[5.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]]), [0])
    rec.observe(0, "p", 1, 0, 2, 1.0)  # rejected at depth 0: token 0 (drafted) does not count -> rank 1
    rec.remember(0, torch.tensor([[5.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]]), [0])
    rec.observe(0, "p", 1, 1, 2, 1.0)  # all accepted: depth 1, tokens 3 is above 2 -> rank 1
    rec.observe(0, "p", 1, 1, 2, 1.0)  # nothing remembered -> -1
    assert [r.rank for r in rec.records] == [1, 1, -1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ranks_predict_the_engine_cache_hits(pair, temperature):
    """hit at fan-out F iff rank < F: checked against the speculation cache's own answer, every round."""
    fan_out = [2, 1, 1, 3]
    params = [SamplingParams(temperature=temperature, max_tokens=20, seed=i, ignore_eos=True) for i in range(4)]
    records, _ = run_ranked(pair[0], pair[1], PROMPTS, params, 3, SpecPlan.fixed(fan_out), 4, 4,
                             build_branches=True)
    checked = [r for r in records if r.rank >= 0 and r.hit is not None]
    assert len(checked) > 20
    for r in checked:
        depth = r.accepted if r.accepted < r.drafted else 3
        assert r.hit == (r.rank < fan_out[depth]), r
    assert any(r.hit for r in checked) and not all(r.hit for r in checked)


def test_summarize_source_curves():
    from saguaro.ssd.ranks import RankRecord
    records = [RankRecord("p", 2, k, rank, 1.0) for k, rank in [(0, 0), (0, 3), (1, 1), (2, 0), (2, 5), (2, 70)]]
    s = summarize_source(records, 2, {})
    curves = np.array(s.hit_curves)
    assert curves.shape == (3, 65) and np.all(np.diff(curves, axis=1) >= 0) and np.all(curves[:, 0] == 0)
    assert curves[0, 1] == 0.5 and curves[0, 4] == 1.0 and curves[2, 1] == pytest.approx(1 / 3)
    assert s.acceptance == pytest.approx(7 / 10)  # conditional a: 7 accepted, 3 rejected
    assert s.accepted_per_drafted == pytest.approx(7 / 12)
    assert s.outcome_pmf == pytest.approx([1 / 3, 1 / 6, 1 / 2]) == s.depth_pmf
    assert s.miss_uniform[64] == pytest.approx(1 / 6)  # rank 70 misses at every stored fan-out


def test_calibrate_tiny_pair_and_store(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    profile = calibrate(pair[0], pair[1], dtype="float32", k=3, temperatures=(0.0, 1.0), c_values=(0.3,),
                        max_tokens=16, batch=4, max_rows=8, prompt_ids=PROMPTS, log=lambda s: None)
    timing = profile.timing
    assert timing.verify_s > 0 and timing.draft_step_s > 0 and set(timing.draft_rows) >= {"1", "4", "8"}
    for t in ("0.0", "1.0"):
        for source in ("primary", "backup"):
            s = getattr(profile.temperatures[t], source)
            assert 0 <= s.acceptance <= 1 and s.rounds > 0 and s.ranked_rounds > 0
            assert len(s.hit_curves) == 4 and sum(s.outcome_pmf) == pytest.approx(1.0)
            assert all(np.all(np.diff(c) >= 0) for c in s.hit_curves)
        rows = profile.temperatures[t].primary.follow_ups  # the round after each primary round
        assert len(rows) > 10 and all(0 <= d <= 3 and r >= 0 and 1 <= jit <= 4 and 1 <= ng <= 4
                                      for d, r, jit, ng in rows)
    sweep = profile.temperatures["1.0"].c_sweep
    assert len(sweep) == 1 and sweep[0].c == 0.3 and len(sweep[0].fan_out) == 4
    assert profile.temperatures["0.0"].c_sweep == []  # greedy rows ignore C
    path = save_profile(profile)
    assert path == profile_path(pair[0].name, pair[1].name, "float32") and path.parent == tmp_path / "profiles"
    assert load_profile(pair[0].name, pair[1].name, "fp32").to_dict() == json.loads(json.dumps(profile.to_dict()))


def test_missing_or_stale_profile_reads_as_none(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    assert load_profile("a", "b", "bfloat16") is None
    profile = default_profile("a", "b", "bfloat16", 4)
    assert profile.default and len(profile.temperatures["1.0"].primary.hit_curves) == 5
    profile.version = 0
    save_profile(profile)
    assert load_profile("a", "b", "bfloat16") is None
    profile_path("a", "b", "bfloat16").write_text("{not json")
    assert load_profile("a", "b", "bf16") is None
    assert math.isclose(default_profile("a", "b", "bf16", 2).timing.target_rows["3"], 1.0)


def test_an_old_or_unknown_profile_asks_to_recalibrate(tmp_path, monkeypatch, caplog):
    """A stored profile without a version, of another version or of another layout is not used; the log
    names the file, the reason and what to do."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    path = profile_path("a", "b", "bfloat16")
    path.parent.mkdir(parents=True)
    good = default_profile("a", "b", "bfloat16", 4).to_dict()
    stale = [({k: v for k, v in good.items() if k != "version"}, "no version"),
             (dict(good, version=0), "version 0"),
             (dict(good, timing={k: v for k, v in good["timing"].items() if k != "verify_s"}), "verify_s"),
             (dict(good, extra=1), "unknown keys ['extra']")]
    for data, reason in stale:
        path.write_text(json.dumps(data))
        caplog.clear()
        with caplog.at_level("WARNING", logger="saguaro.calibration"):
            assert load_profile("a", "b", "bfloat16") is None
        assert str(path) in caplog.text and reason in caplog.text and "re-run `saguaro calibrate`" in caplog.text
    path.write_text(json.dumps(good))
    assert load_profile("a", "b", "bfloat16").to_dict() == good


def test_a_profile_that_says_fast_is_refused(tmp_path, monkeypatch, caplog):
    """The switch was once stored as ``fast`` (the negation of ``enforce_eager``); that spelling was read for a
    release and is now an unknown key: the profile is refused with a log line that says to calibrate again."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    old = default_profile("a", "b", "bfloat16", 4).to_dict()
    del old["enforce_eager"]
    old["fast"] = True  # timed on the fast path
    old["default"] = False
    path = profile_path("a", "b", "bfloat16", False)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old))
    with caplog.at_level("WARNING", logger="saguaro.calibration"):
        assert load_profile("a", "b", "bfloat16", False) is None
    assert "unknown keys ['fast']" in caplog.text and "re-run `saguaro calibrate`" in caplog.text


def test_profiles_are_keyed_by_draft_format(tmp_path, monkeypatch, caplog):
    """An int8 / reduced-head draft has its own profile; the engine falls back to the plain one, with a warning."""
    from saguaro.calibration.store import resolve_profile
    from saguaro.models.draft_format import DraftFormat
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    fmt = DraftFormat("int8", 4096)
    assert fmt.tag == "int8-v4096" and DraftFormat().tag == "" and DraftFormat(vocab=8).tag == "v8"
    assert profile_path("a", "b", "bf16", False, fmt.tag) != profile_path("a", "b", "bf16", False)
    plain = default_profile("a", "b", "bfloat16", 4)
    plain.default, plain.settings["marker"] = False, "plain"
    save_profile(plain)
    with caplog.at_level("WARNING", logger="saguaro"):
        fast = resolve_profile("a", "b", "bfloat16", 4, enforce_eager=False, draft_format=fmt.tag)
        assert fast.settings["marker"] == "plain"
    assert "draft format 'int8-v4096'" in caplog.text
    own = replace(plain, settings={"marker": "int8"}, draft_format=fmt.tag, enforce_eager=False)
    assert save_profile(own) == profile_path("a", "b", "bfloat16", False, fmt.tag)
    fast = resolve_profile("a", "b", "bfloat16", 4, enforce_eager=False, draft_format=fmt.tag)
    assert fast.settings["marker"] == "int8"
    assert resolve_profile("a", "b", "bfloat16", 4, enforce_eager=False).settings["marker"] == "plain"


def test_profiles_are_keyed_by_target_weights(tmp_path, monkeypatch):
    """An int4 target has its own profile (its verification costs a third of a bf16 one's): the engine with that
    target reads it, and never the bf16 target's, which would mislead every cost; without its own, the defaults."""
    from saguaro.calibration.store import resolve_profile
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    assert profile_path("a", "b", "bfloat16", False, target_weights="int4").name == "a@int4__b__bfloat16__fast.json"
    assert profile_path("a", "b", "bfloat16", False, target_weights="bf16") == profile_path("a", "b", "bfloat16", False)
    plain = default_profile("a", "b", "bfloat16", 4)
    plain.default, plain.enforce_eager, plain.settings["marker"] = False, False, "bf16"
    save_profile(plain)
    assert resolve_profile("a", "b", "bfloat16", 4, enforce_eager=False, target_weights="int4").default
    own = replace(plain, settings={"marker": "int4"}, target_weights="int4")
    assert save_profile(own) == profile_path("a", "b", "bfloat16", False, target_weights="int4")
    assert resolve_profile("a", "b", "bfloat16", 4, enforce_eager=False,
                           target_weights="int4").settings["marker"] == "int4"
    assert resolve_profile("a", "b", "bfloat16", 4, enforce_eager=False).settings["marker"] == "bf16"
    assert load_profile("a", "b", "bfloat16", False, target_weights="int4").target_weights == "int4"


def test_profiles_are_keyed_by_workload(tmp_path, monkeypatch, caplog):
    """A code-only calibration has its own profile; the engine's calibration_workload picks it, and falls
    back to the mixed one (with a warning) when it is missing."""
    from saguaro.calibration.store import resolve_profile
    from saguaro.config import Config
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    assert profile_path("a", "b", "bf16", False, "int4", "code").name.endswith("__fast~code.json")
    assert profile_path("a", "b", "bf16", False, "int4", "mixed") == profile_path("a", "b", "bf16", False, "int4")
    with pytest.raises(ValueError, match="workload"):
        profile_path("a", "b", "bf16", workload="poetry")
    with pytest.raises(ValueError, match="calibration_workload"):
        Config(target="a", calibration_workload="poetry")
    mixed = replace(default_profile("a", "b", "bfloat16", 4), default=False, settings={"marker": "mixed"})
    save_profile(mixed)
    with caplog.at_level("WARNING", logger="saguaro"):
        assert resolve_profile("a", "b", "bfloat16", 4, workload="code").settings["marker"] == "mixed"
    assert "workload mixed" in caplog.text
    save_profile(replace(mixed, settings={"marker": "code"}, workload="code"))
    assert resolve_profile("a", "b", "bfloat16", 4, workload="code").settings["marker"] == "code"
    assert resolve_profile("a", "b", "bfloat16", 4).settings["marker"] == "mixed"


def test_calibration_prompts_per_workload():
    """code: the last HumanEval items; chat: the last MT-Bench questions; mixed: both, alternating."""
    from saguaro import datasets
    from saguaro.calibration.measure import calibration_prompts
    from saguaro.loading import load_tokenizer
    tok = load_tokenizer("qwen2.5-coder-1.5b", progress=False)
    last_code, last_chat = datasets.humaneval()[-1], datasets.mtbench()[-1]
    code, chat, mixed = (calibration_prompts(tok, 3, w) for w in ("code", "chat", "mixed"))
    assert len(code) == len(chat) == len(mixed) == 3
    assert last_code.strip()[-40:] in tok.decode(code[0]) and last_chat.strip()[-40:] in tok.decode(chat[0])
    assert tok.decode(mixed[0]) == tok.decode(code[0]) and tok.decode(mixed[1]) == tok.decode(chat[0])
    assert all("Complete this Python function" in tok.decode(p) for p in code)


def test_calibrate_an_int8_draft(pair, tmp_path, monkeypatch):
    """Timings and ranks come from the draft as the engine runs it: int8 weights, reduced head."""
    from saguaro.models.draft_format import DraftFormat
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    fmt = DraftFormat("int8", 48)
    profile = calibrate(pair[0], pair[1], dtype="float32", k=3, temperatures=(0.0,), max_tokens=12, batch=4,
                        max_rows=4, prompt_ids=PROMPTS, log=lambda s: None, draft_format=fmt)
    assert profile.draft_format == "int8-v48" and profile.timing.draft_step_s > 0
    assert profile.temperatures["0.0"].primary.ranked_rounds > 0
    assert save_profile(profile) == profile_path(pair[0].name, pair[1].name, "float32", True, "int8-v48")
    assert next(pair[1].model.parameters()).dtype == torch.float32  # the caller's draft is not converted


def test_b_star_is_said_in_words():
    """A b* at or below 1 (Thm 18 returns one, possibly negative, when n-gram wins from batch 1) is never printed
    as a batch threshold."""
    import math

    from saguaro.calibration.command import _b_star_line
    assert "n-gram at every batch size" in _b_star_line(-3.0)
    assert "n-gram at every batch size" in _b_star_line(1.0)
    assert "jit at every batch size" in _b_star_line(math.inf)
    assert "jit for batch < 4.50" in _b_star_line(4.5)


def test_a_few_mtbench_prompts_mix_categories_and_share_none_with_the_category_datasets():
    from saguaro import datasets
    mixed, math = datasets.mtbench(4), datasets.mtbench(4, ("math",))
    writing = datasets.mtbench(4, ("writing", "roleplay"))
    assert len(set(mixed)) == 4 and not set(mixed) & (set(math) | set(writing))
    assert sorted(datasets.mtbench()) == sorted(datasets.mtbench(80)) and len(set(datasets.mtbench())) == 80


def test_a_profile_timed_on_another_kernel_tier_takes_this_tier_s_row_curves(monkeypatch, caplog):
    """Its one-row times and rates stay; what extra rows cost is the running tier's curve (an int4 target's 3-row
    verification: 1.3x a decode step on avx512, 2.2x on avx2 on one Zen 4 core), and its contention probe moves
    with them."""
    from saguaro.backends.cpu_kernels import build
    from saguaro.calibration import pair_cost, resolve
    from saguaro.calibration.profile import ROW_GRID, PairCosts
    from saguaro.config import Config
    cfg = Config(target="t", draft="d", mode="ssd", dtype="bfloat16")
    curve = {n: 1.0 + 0.6 * (n - 1) for n in ROW_GRID}
    draft_curve = {n: 1.0 + 0.1 * (n - 1) for n in ROW_GRID}
    monkeypatch.setattr(pair_cost, "pair_costs", lambda c: PairCosts(0.2, curve, draft_curve))
    monkeypatch.setattr(build, "best_tier", lambda: "avx512")
    timed = replace(default_profile("t", "d", "bfloat16", 4), default=False, enforce_eager=False, kernels="avx512")
    draft_alone = timed.timing.draft_rows["4"]
    timed.timing.contention = ContentionProbe(busy=[BusyDraft(4, 1.3, 1 / (1.1 * draft_alone))], rows=5)
    monkeypatch.setattr(build, "running_tier", lambda: "avx512")
    assert resolve.on_these_kernels(timed, cfg) is timed
    assert resolve.on_these_kernels(replace(timed, kernels=""), cfg).kernels == ""  # unrecorded: the best tier's
    monkeypatch.setattr(build, "running_tier", lambda: "avx2")
    resolve._warn_other_tier.cache_clear()  # logged once per pair and tiers
    with caplog.at_level("WARNING", logger="saguaro.ssd"):
        moved = resolve.on_these_kernels(timed, cfg)
    assert "avx512 kernels" in caplog.text and moved.kernels == "avx2"
    one, old = timed.timing.target_rows["1"], timed.timing
    assert moved.timing.target_rows["1"] == one and moved.timing.target_rows["3"] == pytest.approx(one * 2.2)
    assert moved.timing.draft_rows["3"] == pytest.approx(old.draft_rows["1"] * 1.2)
    assert moved.timing.verify_s == pytest.approx(one * 3.4)  # K + 1 = 5 rows
    assert moved.timing.T_p == pytest.approx(4 * old.draft_step_s / moved.timing.verify_s)
    assert moved.temperatures == timed.temperatures
    # the probe moves too: the busy draft's and the verification's passes take longer for the same bytes, so
    # each pulls less of the bus: extra slowdowns scale by both time ratios (a 4-row draft pass 1.3x, 5 rows 3.4x)
    (busy,) = moved.timing.contention.busy
    draft_ratio = draft_alone / moved.timing.draft_rows["4"]
    verify_ratio = old.target_rows["5"] / moved.timing.target_rows["5"]
    assert draft_ratio == pytest.approx(old.draft_rows["4"] / (old.draft_rows["1"] * 1.3))
    assert verify_ratio == pytest.approx(old.target_rows["5"] / (one * 3.4))
    assert busy.slowdown == pytest.approx(1.0 + 0.3 * draft_ratio * verify_ratio)
    assert busy.draft_passes_per_s == pytest.approx(1 / (moved.timing.draft_rows["4"] * (1.0 + 0.1 * verify_ratio)))
    assert old.contention.busy[0].slowdown == 1.3  # the stored profile is left as it was
    assert resolve.on_these_kernels(replace(timed, kernels=""), cfg).kernels == "avx2"  # calibrated on avx512
    for unchanged in (replace(timed, enforce_eager=True), replace(timed, default=True)):
        assert resolve.on_these_kernels(unchanged, cfg) is unchanged  # eager timings, or the defaults' own curves
    assert resolve.on_these_kernels(timed, replace(cfg, enforce_eager=True)) is timed
    monkeypatch.setattr(build, "running_tier", lambda: None)  # no kernels load: the engine runs eager
    assert resolve.on_these_kernels(timed, cfg) is timed
