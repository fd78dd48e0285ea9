"""``bench gpu --mode ssd`` end to end on the CPU (tiny shapes, a few tokens): every configuration runs, and the
JSON carries what the GPU run will be read for. No timing is asserted: CPU speeds here mean nothing."""
import argparse
import json

import pytest

from benchmarks import bench_gpu
from benchmarks.bench_gpu_ssd import parse_args, projections, ssd_shapes
from benchmarks.gpu_ssd_rows import SSDShape
from saguaro.calibration import default_profile


def test_ssd_mode_end_to_end_on_cpu(tmp_path):
    profile = tmp_path / "profile.json"  # the documented defaults stand in for the real pair's profile
    profile.write_text(json.dumps(default_profile("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "bfloat16").to_dict()))
    assert bench_gpu.main(["--mode", "ssd", "--device", "cpu", "--shape", "tiny", "--prompts", "1", "--prompt-len",
                           "16", "--max-tokens", "8", "--sd-k", "2", "--ssd", "2:uniform;2:last2@1", "--reps", "1",
                           "--verify-rows", "2,3,4,5,6,7", "--tree-rows", "4", "--project", "tiny:tiny",
                           "--profile", str(profile), "--out", str(tmp_path), "--name", "smoke"]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").read_text().startswith("# SSD, SD and AR on one device")
    assert result["pair"]["shape"] == "tiny" and result["pair"]["draft_layers"] == 2
    assert "CPU" in result["pair"]["hardware"] and "random token ids" in result["pair"]["prompt_source"]
    rows = {r["name"]: r for r in result["rows"]}
    # on the CPU's own backend only the Python build runs (the graph build needs the paged backend: --paged)
    ssd_names = ("SSD K=2 F=[1,1,1], python build", "SSD K=2 F=[1,1,2], tapered 1+1, python build")
    assert set(rows) == {"AR", "SD K=2", *ssd_names}
    for r in rows.values():
        assert r["tok_s"] > 0 and r["verify_ms"] > 0
    for name in ssd_names:
        ssd = rows[name]
        assert ssd["build"] == "python" and ssd["torch_calls_per_build"] > 0 and ssd["device_reads_per_round"] > 0
        assert ssd["mode"] == "ssd" and 0.0 <= ssd["p_hit"] <= 1.0 and ssd["tokens_per_round"] >= 1.0
        assert ssd["verify_alone_ms"] == rows["SD K=2"]["verify_ms"] and ssd["beside_over_alone"] > 0
        assert ssd["verify_pass_ms"] > 0 and ssd["predicted_tok_s"] > 0 and ssd["prediction_error"] is not None
        assert ssd["lanes"]["source"] == "cpu" and "not a CUDA device" in ssd["lanes"]["detail"]
    (best,) = result["best"]
    assert best["sd"] == "SD K=2" and best["ssd"].startswith("SSD") and best["ssd_over_sd"] > 0
    assert {"rows_1", "rows_3"} <= set(result["passes"]["target"]) and "tree_3" in result["passes"]["draft"]
    (projection,) = result["projections"]
    assert projection["target"] == "tiny" and projection["ssd_tok_s"] > 0 and projection["sd_k"] in range(2, 7)


def test_the_graph_build_rows_on_the_paged_stand_in(tmp_path):
    """--paged: every configuration on the paged backend's CPU stand-in, each SSD configuration with the Python
    build and the graph build; the new columns in the table and the JSON."""
    assert bench_gpu.main(["--mode", "ssd", "--device", "cpu", "--shape", "tiny", "--paged", "--prompts", "1",
                           "--prompt-len", "16", "--max-tokens", "8", "--sd-k", "2", "--ssd", "2:uniform", "--reps",
                           "1", "--verify-rows", "2,3", "--tree-rows", "4", "--project", "none", "--warmup-tokens",
                           "0", "--out", str(tmp_path), "--name", "paged"]) == 0
    result = json.loads((tmp_path / "paged.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    python, graph = rows["SSD K=2 F=[1,1,1], python build"], rows["SSD K=2 F=[1,1,1], graph build"]
    assert python["build"] == "python" and graph["build"] == "graph" and graph["tok_s"] > 0
    assert graph["torch_calls_per_build"] <= 25 < python["torch_calls_per_build"]
    assert 0 < graph["device_reads_per_round"] <= 1  # at most one per round (none while there is nothing to read)
    assert graph["device_reads_per_round"] < python["device_reads_per_round"]
    text = (tmp_path / "paged.md").read_text()
    assert "calls/build" in text and "reads/round" in text and "--paged" in text


def test_batched_rows_run_every_configuration_with_several_requests(tmp_path):
    """--batches 1,3: the batch-1 table as before, and every configuration again with 3 requests together (both
    builds on the paged stand-in): all-request and per-request tok/s, ratios to AR and the best SD at that size,
    acceptance and SSD's p_hit; in the table and the JSON."""
    assert bench_gpu.main(["--mode", "ssd", "--device", "cpu", "--shape", "tiny", "--paged", "--prompts", "1",
                           "--prompt-len", "16", "--max-tokens", "8", "--sd-k", "2", "--ssd", "2:uniform", "--reps",
                           "1", "--verify-rows", "2,3", "--tree-rows", "4", "--project", "none", "--warmup-tokens",
                           "0", "--batches", "1,3", "--out", str(tmp_path), "--name", "batched"]) == 0
    result = json.loads((tmp_path / "batched.json").read_text())
    names = {r["name"] for r in result["rows"]}
    batched = {r["name"]: r for r in result["batched_rows"]}
    assert set(batched) == names and {r["batch"] for r in batched.values()} == {3}
    for r in batched.values():
        assert r["tok_s"] > 0 and r["per_request_tok_s"] > 0 and r["failure"] is None
        assert (r["p_hit"] is not None) == (r["mode"] == "ssd") and (r["acceptance"] is None) == (r["mode"] == "ar")
    text = (tmp_path / "batched.md").read_text()
    assert text.startswith("# SSD, SD and AR on one device: synthetic tiny pair, bf16, batch 1, 3")
    assert "## Batch 3, T=0" in text and "per request" in text


def test_ssd_configurations_parse_and_refuse_what_they_cannot_predict():
    assert ssd_shapes("4:last3@2; 2:uniform") == [SSDShape(4, [1, 1, 1, 1, 3], 2), SSDShape(2, [1, 1, 1])]
    for bad in ("4:auto", "4:1,1,2", "x:uniform", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            ssd_shapes(bad)


def test_projections_without_the_real_pairs_profile_say_so(tmp_path):
    rows, notes = projections(parse_args(["--device", "cpu", "--profile", str(tmp_path / "absent.json")]))
    assert rows == [] and "Projections skipped: no profile" in notes[0]


def test_the_committed_real_pair_profile_loads():
    """The projections read the real pair's committed profile (results/): it must load with today's schema, else
    every GPU run skips them (it once kept a key the schema had renamed)."""
    from benchmarks.gpu_projection import PROFILE_PATH, load_profile
    assert PROFILE_PATH.exists()
    profile = load_profile()
    assert profile is not None and profile.temperatures


@pytest.mark.worker_failure
def test_a_speculator_killed_mid_benchmark_fails_its_row_and_the_command(tmp_path, monkeypatch):
    """The speculator thread dies at its third response: the SSD row records why, is marked failed, is not
    the best SSD, and the command exits non-zero (its figures are n-gram SD's, not SSD's)."""
    from saguaro.ssd.speculator import Speculator
    real, calls = Speculator.respond, []

    def respond(self, request):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("speculator killed by the test")
        return real(self, request)
    monkeypatch.setattr(Speculator, "respond", respond)
    assert bench_gpu.main(["--mode", "ssd", "--device", "cpu", "--shape", "tiny", "--prompts", "1", "--prompt-len",
                           "16", "--max-tokens", "8", "--sd-k", "2", "--ssd", "2:uniform", "--reps", "1",
                           "--verify-rows", "2,3", "--tree-rows", "4", "--project", "none", "--warmup-tokens", "0",
                           "--out", str(tmp_path), "--name", "killed"]) == 1
    result = json.loads((tmp_path / "killed.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    failure = rows["SSD K=2 F=[1,1,1], python build"]["failure"]
    assert "speculator killed by the test" in failure
    assert result["failed"] == {"SSD K=2 F=[1,1,1], python build": failure}
    assert rows["AR"]["failure"] is None and rows["SD K=2"]["failure"] is None
    assert result["best"] == []  # no SSD row stands: nothing is compared as SSD
    assert "SSD K=2 F=[1,1,1], python build FAILED" in (tmp_path / "killed.md").read_text()


def test_priority_rows_run_with_the_setting_off_and_on(tmp_path, monkeypatch):
    """--priorities off,on: each SSD configuration twice, its speculator thread started with the setting off, then
    on (on the CPU it changes nothing; the rows are run for the setting's plumbing). The default: both on a GPU,
    once on a CPU."""
    from saguaro.ssd import stream_priority, thread_link
    seen = []
    real = thread_link.lane_priorities
    monkeypatch.setattr(thread_link, "lane_priorities", lambda device, on=None: seen.append(stream_priority.enabled())
                        or real(device, on))
    assert bench_gpu.main(["--mode", "ssd", "--device", "cpu", "--shape", "tiny", "--prompts", "1", "--prompt-len",
                           "16", "--max-tokens", "6", "--sd-k", "2", "--ssd", "2:uniform", "--builds", "python",
                           "--priorities", "off,on", "--reps", "1", "--verify-rows", "2,3", "--tree-rows", "4",
                           "--project", "none", "--warmup-tokens", "0", "--out", str(tmp_path), "--name", "prio"]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "prio.json").read_text())["rows"]}
    assert {"SSD K=2 F=[1,1,1], python build, priorities off", "SSD K=2 F=[1,1,1], python build, priorities on"} <= set(
        rows)
    assert False in seen and True in seen and seen.index(False) < seen.index(True)
    assert all(r["priorities"] is None for r in rows.values())  # the CPU: no streams to order
    assert parse_args(["--device", "cpu"]).priorities == ["on"]
    assert parse_args(["--device", "cuda:0"]).priorities == ["auto", "off", "on"]
    with pytest.raises(SystemExit):
        parse_args(["--priorities", "high"])


def test_the_rows_say_which_arrangement_the_engine_used_and_whence(tmp_path, monkeypatch):
    """--priorities auto: the engine's own choice, here the overlap probe's verdict for a card (its name standing
    in on the CPU); on: priorities on, all SMs, set over the verdict. Both in the JSON's ``lanes`` and the table."""
    import torch
    from saguaro.ssd import lane_profile
    from saguaro.ssd.lane_profile import Arrangement, Candidate, LaneProfile, save_lane_profile
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    monkeypatch.setattr(lane_profile, "device_card", lambda device: "NVIDIA H200")
    best = Candidate(Arrangement(False, 16), 1.5, 1.1, 1.4, 0.02)
    save_lane_profile(LaneProfile("NVIDIA H200", torch.__version__, best, [best]))
    assert bench_gpu.main(["--mode", "ssd", "--device", "cpu", "--shape", "tiny", "--prompts", "1", "--prompt-len",
                           "16", "--max-tokens", "6", "--sd-k", "2", "--ssd", "2:uniform", "--builds", "python",
                           "--priorities", "auto,on", "--reps", "1", "--verify-rows", "2,3", "--tree-rows", "4",
                           "--project", "none", "--warmup-tokens", "0", "--out", str(tmp_path), "--name", "lanes"]) == 0
    rows = {r["name"]: r["lanes"] for r in json.loads((tmp_path / "lanes.json").read_text())["rows"]}
    auto, on = rows["SSD K=2 F=[1,1,1], python build, priorities auto"], rows["SSD K=2 F=[1,1,1], python build, "
                                                                              "priorities on"]
    assert (auto["priorities"], auto["sms"], auto["source"]) == (False, 16, "profile")
    assert (on["priorities"], on["sms"], on["source"]) == (True, None, "setting")
    assert rows["AR"] is None and rows["SD K=2"] is None
    text = (tmp_path / "lanes.md").read_text()
    assert "prio off, 16 SMs (profile)" in text and "prio on, all SMs (setting)" in text
    assert "Lanes (profile): the overlap probe's verdict" in text
