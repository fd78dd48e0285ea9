"""The GPU check, proven without a GPU: ``scripts/gpu_check.sh --dry-run`` collects every gpu-marked test with only
the GPU machine's packages importable and imports every benchmark module; the overlap probe reports instead of
hanging (its watchdog kills a child that overruns) and skips cleanly without CUDA."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_overlap import main as overlap_main, watched

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_collects_every_gpu_test_on_the_gpu_machines_packages():
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dry run passed" in done.stdout
    counts = [int(line.split()[2]) for line in done.stdout.splitlines() if line.startswith("== collection:")]
    assert len(counts) == 2 and counts[0] == counts[1] > 0


def test_the_dry_run_fails_on_a_gpu_test_module_that_needs_a_missing_package(tmp_path):
    """Negative control: a gpu test whose module imports openai at top collects here but not on the GPU machine."""
    pytest.importorskip("openai")
    (tmp_path / "test_planted.py").write_text("import openai\nimport pytest\n\n\n@pytest.mark.gpu\n"
                                              "def test_needs_the_server_packages():\n    assert openai\n")
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "SAGUARO_GPU_TESTS": str(tmp_path)})
    assert done.returncode != 0 and "dry run passed" not in done.stdout
    assert "1 tests marked gpu" in done.stdout and "No module named 'openai'" in done.stderr


def test_the_gpu_machines_packages_hide_the_others():
    probe = "import importlib.util as u; print([u.find_spec(m) is None for m in ('openai', 'gguf', 'torch')])"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{ROOT / 'scripts' / 'gpu_env'}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip() == "[True, True, False]", done.stderr[-2000:]


def test_the_watchdog_kills_a_child_that_overruns():
    t0 = time.perf_counter()
    result = watched(["--reps", "1"], watchdog_s=0.2)  # the child cannot even import torch in that time
    assert result["status"] == "hung" and "killed" in result["detail"]
    assert time.perf_counter() - t0 < 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path; the GPU check runs the real probe")
def test_the_overlap_probe_skips_without_cuda(tmp_path):
    assert overlap_main(["--watchdog-s", "300", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_overlap.json").read_text())
    assert result["status"] == "skipped" and "no CUDA" in result["detail"]
    assert "Status: **skipped**" in (tmp_path / "gpu_overlap.md").read_text()


def test_the_overlap_probe_measures_priorities_and_green_contexts_and_reports_both_sides():
    """The configurations (priorities off and on; the draft on all SMs and in green contexts of 16, 32 and 66 SMs),
    the figures derived from a configuration's medians, and the table, from a result as the child writes it."""
    from benchmarks.gpu_overlap import LaneResult, best, configurations, parse_args, report
    args = parse_args([])
    names = [c.name for c in configurations(args)]
    assert len(names) == 8 and names[:2] == ["priorities off, draft on all SMs", "priorities on, draft on all SMs"]
    assert {c.sms for c in configurations(args)} == {None, 16, 32, 66}
    assert [c.name for c in configurations(parse_args(["--priorities", "on", "--sms", "32"]))] == [
        "priorities on, draft on all SMs", "priorities on, draft on 32 SMs"]
    fast = LaneResult("a", verify_alone_ms=2.0, draft_alone_ms=3.0, verify_beside_ms=2.5, draft_beside_ms=4.5,
                      sequential_ms=5.2, together_ms=4.0).to_dict()
    assert (fast["verify_slowdown"], fast["draft_slowdown"], fast["together_speedup"]) == (1.25, 1.5, 1.3)
    failed = LaneResult("b", error="RuntimeError: no green context").to_dict()
    assert failed["together_speedup"] is None and best([failed, fast])["name"] == "a" and best([failed]) is None
    text = report({"status": "ok", "device": "a GPU", "configurations": [fast, failed]}, args)
    assert "verify slowdown" in text and "together speed-up" in text and "1.30" in text
    assert "b FAILED: RuntimeError: no green context" in text and "Best: a (1.30x faster together)" in text
