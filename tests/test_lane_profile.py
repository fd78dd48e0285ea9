"""The overlap probe's verdict as the engine's arrangement of one GPU (``saguaro/ssd/lane_profile.py``), checked on
the CPU: the profile's round trip, the choice (the probe's own figure; ties within its spread go to the default;
failed arrangements never win), the profiles refused (another version, card or torch), the settings over it, and
a speculator thread's start-up reading it with the card's name standing in for a GPU and no CUDA call made."""
import json
import logging

import pytest
import torch

from saguaro.ssd import lane_profile
from saguaro.ssd.lane_profile import (DEFAULT, Arrangement, Candidate, LaneProfile, lane_profile_path,
                                      read_lane_profile, resolve_lanes, save_lane_profile, verdict)

CARD = "NVIDIA H200"


def _candidates(spread: float | None = 0.01) -> list[Candidate]:
    return [Candidate(Arrangement(False, None), 1.20, 1.50, 1.30, spread),
            Candidate(Arrangement(True, None), 1.25, 1.40, 1.35, spread),
            Candidate(Arrangement(True, 32), 1.40, 1.20, 1.60, spread),
            Candidate(Arrangement(True, 66), 0.0)]  # failed: a green context refused, no figure


def _profile(best: Candidate | None = None, card: str = CARD, version: str | None = None) -> LaneProfile:
    weighed = _candidates()
    return LaneProfile(card, version or torch.__version__, best or verdict(weighed), weighed,
                       settings={"verify_rows": 5})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    for name in (lane_profile.PRIORITIES_ENV, lane_profile.SMS_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_profile_round_trips_beside_the_calibration_profiles(cache):
    path = save_lane_profile(_profile())
    assert path == cache / "profiles" / "lanes__NVIDIA_H200.json" == lane_profile_path(CARD)
    read, why = read_lane_profile(path, CARD, torch.__version__)
    assert read == LaneProfile.from_dict(json.loads(path.read_text())) and read.created
    assert read.best == Candidate(Arrangement(True, 32), 1.40, 1.20, 1.60, 0.01) and len(read.candidates) == 4
    assert "1.40x faster together" in why and CARD in why


def test_the_best_is_the_probes_own_figure_and_a_failed_arrangement_never_wins():
    assert verdict(_candidates()).arrangement == Arrangement(True, 32)  # not the smallest verification slowdown
    assert verdict([Candidate(Arrangement(True, 66), 0.0)]) is None and verdict([]) is None
    two = [Candidate(Arrangement(True, None), 1.1), Candidate(Arrangement(False, 16), 1.3)]
    assert verdict(two).arrangement == Arrangement(False, 16)


def test_ties_within_the_best_ones_spread_go_to_the_arrangement_nearest_the_default():
    green = Candidate(Arrangement(True, 32), 1.30, 1.10, None, 0.05)
    default = Candidate(DEFAULT, 1.26, 1.30, None, 0.05)
    off = Candidate(Arrangement(False, None), 1.27, 1.20, None, 0.05)
    assert verdict([green, off, default]) == default  # all within 5% of 1.30: no green context, priorities on
    assert verdict([green, off]) == off  # no green context before priorities
    exact = [Candidate(Arrangement(True, 16), 1.3, 1.4), Candidate(Arrangement(True, 32), 1.3, 1.2)]
    assert verdict(exact).arrangement.sms == 32  # equal otherwise: the smaller verification slowdown
    # negative control: outside the spread the faster one wins, green context or not
    assert verdict([Candidate(Arrangement(True, 32), 1.30, 1.1, None, 0.01), default]).arrangement.sms == 32


def test_a_profile_of_another_version_card_or_torch_is_refused_saying_why(cache):
    path = save_lane_profile(_profile())
    assert read_lane_profile(path, "NVIDIA H100 80GB HBM3", torch.__version__)[0] is None
    assert "another card (NVIDIA H200" in read_lane_profile(path, "NVIDIA H100 80GB HBM3", torch.__version__)[1]
    profile, why = read_lane_profile(path, CARD, "2.11.0+cu130")
    assert profile is None and "torch" in why and "2.11.0+cu130" in why
    stale = json.loads(path.read_text()) | {"version": 0}
    path.write_text(json.dumps(stale))
    assert "version 0" in read_lane_profile(path, CARD, torch.__version__)[1]
    path.write_text(json.dumps(json.loads(path.read_text()) | {"version": 1, "extra": 1}))
    assert "unknown keys ['extra']" in read_lane_profile(path, CARD, torch.__version__)[1]
    path.write_text("{not json")
    assert "cannot be used" in read_lane_profile(path, CARD, torch.__version__)[1]
    assert "no overlap-probe profile" in read_lane_profile(cache / "none.json", CARD, torch.__version__)[1]


def _on_card(monkeypatch, card: str = CARD) -> None:
    """A CUDA card's name for any device, and every CUDA call that would reach a device refused."""
    monkeypatch.setattr(lane_profile, "device_card", lambda device: card)

    def refused(*args, **kwargs):
        raise AssertionError("a CUDA call on the CPU path")
    for name in ("get_device_name", "set_device", "Stream", "Event", "current_stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, refused)


def test_the_card_reads_its_profile_and_the_settings_override_it(cache, monkeypatch):
    save_lane_profile(_profile())
    assert resolve_lanes("cpu").source == "cpu"  # no card: nothing read
    _on_card(monkeypatch)
    chosen = resolve_lanes("cuda:0")
    assert (chosen.priorities, chosen.sms, chosen.source) == (True, 32, "profile")
    both = resolve_lanes("cuda:0", {lane_profile.PRIORITIES_ENV: "0", lane_profile.SMS_ENV: "all"})
    assert (both.priorities, both.sms, both.source) == (False, None, "setting")
    assert "SAGUARO_STREAM_PRIORITIES=0" in both.detail and "overlap probe's verdict" in both.detail
    assert resolve_lanes("cuda:0", {lane_profile.SMS_ENV: "16"}).arrangement == Arrangement(True, 16)
    with pytest.raises(ValueError, match="SAGUARO_SPECULATOR_SMS"):
        resolve_lanes("cuda:0", {lane_profile.SMS_ENV: "half"})


@pytest.mark.parametrize("card, version", [("NVIDIA H100 80GB HBM3", None), (CARD, "2.11.0+cu130"), (None, None)])
def test_without_a_usable_profile_the_default_with_one_line_saying_why(cache, monkeypatch, caplog, card, version):
    if card is not None:
        save_lane_profile(_profile(card=card, version=version))
    _on_card(monkeypatch)
    with caplog.at_level(logging.INFO, logger="saguaro.ssd"):
        chosen = resolve_lanes("cuda:0")
    assert chosen.arrangement == DEFAULT == Arrangement(True, None) and chosen.source == "default"
    (record,) = caplog.records
    assert "today's default" in record.getMessage() and chosen.detail in record.getMessage()


def test_a_speculator_thread_starts_with_the_profiles_arrangement_and_no_cuda_call(cache, monkeypatch):
    """The engine's start-up on the CPU with a card's name standing in: the arrangement is resolved and reported
    (``link.lanes``), the CPU lane runs as ever, and nothing reaches CUDA."""
    from saguaro import LLM, SamplingParams
    from tests.tiny import weak_pair
    save_lane_profile(_profile(best=Candidate(Arrangement(False, 16), 1.5)))
    _on_card(monkeypatch)
    target, draft = weak_pair()
    with LLM(target, draft=draft, mode="ssd", num_speculative_tokens=3, block_size=4,
             speculator_transport="thread") as llm:
        link = llm.engine.decoder.link
        assert (link.lanes.priorities, link.lanes.sms, link.lanes.source) == (False, 16, "profile")
        assert link.target_lane.stream is None  # the CPU: no stream, whatever the verdict
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6))
    assert len(out[0].token_ids) == 6 and llm.engine.decoder.failure is None


def test_the_probe_saves_its_verdict_and_nothing_when_it_measured_nothing(cache, tmp_path, monkeypatch):
    """The probe's parent with a child's result as the child writes it: the verdict (the fastest together; a failed
    arrangement skipped) saved where the engine reads it, and in the probe's own JSON and table."""
    from benchmarks import gpu_overlap
    from benchmarks.gpu_overlap import LaneResult
    rows = [LaneResult("off", 2.0, 3.0, 2.6, 4.0, 5.0, 4.4, priorities=False, together_spread=0.01).to_dict(),
            LaneResult("on, 32", 2.0, 3.5, 2.2, 4.2, 5.5, 4.3, priorities=True, sms=32, together_spread=0.01).to_dict(),
            LaneResult("on, 66", error="RuntimeError: refused", priorities=True, sms=66).to_dict()]
    child = {"status": "ok", "device": CARD, "torch": torch.__version__, "configurations": rows}
    monkeypatch.setattr(gpu_overlap, "watched", lambda argv, watchdog_s: dict(child))
    assert gpu_overlap.main(["--out", str(tmp_path / "out"), "--sms", "32,66"]) == 0
    profile, _ = read_lane_profile(lane_profile_path(CARD), CARD, torch.__version__)
    assert profile.best.arrangement == Arrangement(True, 32) and len(profile.candidates) == 3
    assert profile.settings["verify_rows"] == 5 and profile.best.together_speedup == pytest.approx(5.5 / 4.3)
    written = json.loads((tmp_path / "out" / "gpu_overlap.json").read_text())
    assert written["verdict"] == profile.to_dict() and written["profile_path"] == str(lane_profile_path(CARD))
    assert "Saved as the engine's arrangement on this card" in (tmp_path / "out" / "gpu_overlap.md").read_text()
    lane_profile_path(CARD).unlink()
    monkeypatch.setattr(gpu_overlap, "watched", lambda argv, watchdog_s: {"status": "hung", "detail": "killed"})
    assert gpu_overlap.main(["--out", str(tmp_path / "out")]) == 1
    assert not lane_profile_path(CARD).exists() and "verdict" not in json.loads(
        (tmp_path / "out" / "gpu_overlap.json").read_text())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_speculator_runs_in_the_profiles_arrangement(cache):
    """The real card's profile: priorities off and a green context of 16 SMs; greedy SSD still equals AR."""
    from saguaro import LLM, SamplingParams
    from saguaro.ssd import thread_link
    from tests.tiny import tiny_model, truncated
    card = torch.cuda.get_device_name(0)
    best = Candidate(Arrangement(False, 16), 1.5)
    save_lane_profile(LaneProfile(card, torch.__version__, best, [best]))
    target, prompts = tiny_model(seed=3, layers=3, sharpness=3.0), [[1, 2, 3], [7]]
    params = SamplingParams(max_tokens=16)
    with LLM(target, block_size=4) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, params)]
    with LLM(target=target, draft=truncated(target, 1), mode="ssd", device="cuda:0", num_speculative_tokens=3,
             fan_out=[1, 1, 1, 2], block_size=4, speculator_transport="thread") as llm:
        link = llm.engine.decoder.link
        assert link.lanes.source == "profile" and not link.lanes.priorities
        assert link.target_lane.stream is None  # priorities off: the target's rounds where they are
        from torch.cuda.green_contexts import GreenContext
        assert link.lanes.sms == (16 if hasattr(GreenContext, "Stream") else None)
        if link.lanes.sms:
            assert (0, 16) in thread_link._GREEN_CONTEXTS
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.decoder.failure is None
