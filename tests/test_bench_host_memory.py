"""The host-memory figures of ``bench gpu`` (a smoke run on the CPU with the tiny synthetic pair): the process's
resident memory after building the models and with each engine loaded."""
import json

from benchmarks import bench_gpu


def test_bench_gpu_reports_host_memory(tmp_path, capsys):
    assert bench_gpu.main(["--device", "cpu", "--shapes", "tiny", "--context", "16", "--max-tokens", "4",
                           "--batches", "1", "--sd-k", "2", "--verify-rows", "2", "--tree-rows", "8", "--reps", "1",
                           "--no-hf", "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "bench_gpu.json").read_text())["results"]
    assert 0.05 < result["host_rss_gb"] < 64
    assert [e["mode"] for e in result["engine"]] == ["ar", "sd"]
    assert all(0.05 < e["host_rss_gb"] < 64 for e in result["engine"])
    assert "host RSS GB" in capsys.readouterr().out
