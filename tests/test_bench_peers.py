"""The llama.cpp peer benchmark without llama.cpp: its output parsed from recorded samples, the command lines it
builds, the source unpacking, and a clear error (no build, no network) when the toolchain is missing.
"""
# ruff: noqa: E501  (the recorded log lines stay as llama.cpp printed them)
import io
import tarfile

import pytest

from benchmarks import bench_peers as bp
from benchmarks import llama_cpp as lc

# The tail of `llama-completion` (0.5B Q4_K_M, greedy, 4 tokens, "def f():") on this machine: its log (stderr)
# prefixes every line with a time stamp and a level.
COMPLETION_LOG = """\
0.08.894.172 I common_perf_print:    sampling time =      15.50 ms
0.08.894.174 I common_perf_print:    samplers time =       1.11 ms /     7 tokens
0.08.894.177 I common_perf_print:        load time =    3485.11 ms
0.08.894.178 I common_perf_print: prompt eval time =     716.75 ms /     3 tokens (  238.92 ms per token,     4.19 tokens per second)
0.08.894.179 I common_perf_print:        eval time =     945.87 ms /     3 runs   (  315.29 ms per token,     3.17 tokens per second)
0.08.894.180 I common_perf_print:       total time =    1687.33 ms /     6 tokens
0.08.894.181 I common_perf_print: unaccounted time =       9.21 ms /   0.5 %      (total - sampling - prompt eval - eval) / (total)
0.08.894.181 I common_perf_print:    graphs reused =          2
"""

# The summary of `llama-speculative-simple` (draft 4), as its source prints it, with the same line prefixes.
SPECULATIVE_LOG = """\
0.20.100.000 I encoded  143 tokens in    9.871 seconds, speed:   14.487 t/s
0.20.101.000 I decoded   49 tokens in    4.102 seconds, speed:   11.945 t/s

0.20.103.000 I n_draft   = 4
0.20.104.000 I n_predict = 49
0.20.105.000 I n_drafted = 48
0.20.106.000 I n_accept  = 37
0.20.107.000 I accept    = 77.083%

0.20.109.000 I draft:

0.21.111.000 I target:

0.21.113.000 I common_perf_print:        load time =    1534.77 ms
0.21.114.000 I common_perf_print: prompt eval time =    9012.55 ms /   142 tokens (   63.47 ms per token,    15.76 tokens per second)
0.21.115.000 I common_perf_print:        eval time =    3580.21 ms /    12 runs   (  298.35 ms per token,     3.35 tokens per second)
"""


def test_completion_timing_is_the_eval_line_not_the_prompt_line():
    t = lc.parse_completion(COMPLETION_LOG)
    assert t.decode_tokens == 3 and t.decode_s == pytest.approx(0.94587)
    assert t.tok_s == pytest.approx(3 / 0.94587)
    assert t.prompt_tokens == 3 and t.acceptance is None


def test_speculative_timing_and_acceptance():
    t = lc.parse_speculative(SPECULATIVE_LOG)
    assert (t.decode_tokens, t.decode_s, t.tok_s) == (49, pytest.approx(4.102), pytest.approx(11.945))
    assert (t.drafted, t.accepted, t.prompt_tokens) == (48, 37, 143)
    assert t.acceptance == pytest.approx(37 / 48)


@pytest.mark.parametrize("parse", [lc.parse_completion, lc.parse_speculative])
def test_output_without_timings_is_an_error(parse):
    with pytest.raises(lc.PeerRunError, match="line"):
        parse("error: failed to load model\n")


def test_command_lines(tmp_path):
    b = lc.Build(tmp_path)
    m, d, f = tmp_path / "t.gguf", tmp_path / "d.gguf", tmp_path / "p.txt"
    ar = lc.completion_command(b, m, f, 48, 1)
    assert ar[0] == str(tmp_path / "build" / "bin" / "llama-completion")
    for flag, value in (("-m", m), ("-f", f), ("-n", 48), ("-t", 1), ("-tb", 1), ("--temp", 0)):
        assert ar[ar.index(flag) + 1] == str(value)
    assert "-no-cnv" in ar and "--no-display-prompt" in ar
    spec = lc.speculative_command(b, m, d, f, 48, 1, 4)
    assert spec[0].endswith("llama-speculative-simple")
    assert spec[spec.index("--spec-type") + 1] == "draft-simple"  # a draft model, not n-grams
    for flag, value in (("-md", d), ("--spec-draft-n-max", 4), ("--spec-draft-p-min", 0), ("-td", 1), ("--temp", 0)):
        assert spec[spec.index(flag) + 1] == str(value)
    q = lc.quantize_command(b, m, d)
    assert q[1] == "--allow-requantize" and q[-1] == "BF16"
    cfg = lc.configure_command(b)
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"} <= set(cfg)
    assert lc.compile_command(b, 2)[-len(lc.TOOLS):] == list(lc.TOOLS)
    dl = lc.download_command(tmp_path)
    assert f"llama-cpp-python=={lc.VERSION}" in dl and ":all:" in dl


def test_only_the_vendored_sources_are_unpacked(tmp_path):
    archive = tmp_path / "pkg.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("pkg-1/setup.py", b"x"), ("pkg-1/vendor/llama.cpp/CMakeLists.txt", b"project()"),
                           ("pkg-1/vendor/llama.cpp/.git", b"gitdir: ../../.git"),
                           ("pkg-1/vendor/llama.cpp/src/a.cpp", b"int a;")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    lc._extract_vendor(archive, tmp_path / "src")
    got = sorted(str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*") if p.is_file())
    assert got == ["CMakeLists.txt", "src/a.cpp"]


def test_missing_toolchain_is_a_clear_error_and_exit_code(tmp_path, monkeypatch, capsys):
    assert lc.missing_toolchain(lambda name: None) == [
        "cmake", "a C compiler (cc, gcc or clang)", "a C++ compiler (c++, g++ or clang++)"]
    assert lc.missing_toolchain(lambda name: None if name == "cmake" else f"/usr/bin/{name}") == ["cmake"]
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))  # no cached build
    monkeypatch.setattr(lc.shutil, "which", lambda name: None)
    monkeypatch.setattr(lc.subprocess, "run", lambda *a, **k: pytest.fail("nothing may run without a toolchain"))
    assert bp.main(["--only", "llama-q4-ar", "--out", str(tmp_path)]) == lc.EXIT_NO_TOOLCHAIN
    err = capsys.readouterr().err
    assert "cannot build llama.cpp: missing cmake" in err and "apt-get install cmake" in err


def test_skip_build_without_a_build_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    assert bp.main(["--only", "llama.cpp", "--skip-build", "--out", str(tmp_path)]) == 1
    assert "no llama.cpp build at" in capsys.readouterr().err


def test_only_takes_row_keys_and_engine_groups():
    assert bp.parse_args(["--only", "saguaro"]).only == ["saguaro-ar", "saguaro-sd", "saguaro-ssd", "saguaro-q4-ar",
                                                         "saguaro-q4-sd", "saguaro-q4-ssd"]
    assert bp.parse_args(["--only", "saguaro-ar,llama-q4-ar"]).only == ["llama-q4-ar", "saguaro-ar"]
    with pytest.raises(SystemExit):
        bp.parse_args(["--only", "vllm"])
    with pytest.raises(SystemExit):
        bp.parse_args(["--temperatures", "1"])


def test_ratios_are_against_the_fastest_llama_row_on_the_target_and_our_ar():
    rows = [r for r in bp.ROWS if r.key in ("llama-q4-ar", "llama-draft-q4-ar", "llama-bf16-ar", "saguaro-ar")]
    speeds = {"llama-q4-ar": 20.0, "llama-draft-q4-ar": 50.0, "llama-bf16-ar": 8.0, "saguaro-ar": 10.0}
    summaries = {k: {"tok_s_median": v, "tok_s_min": v, "tok_s_max": v, "requests": 2} for k, v in speeds.items()}
    text, out = bp.speed_table(rows, {r.key: r.label for r in rows}, summaries)
    assert out["llama_fastest"] == "llama-q4-ar"  # the draft alone decodes another model
    assert out["ratios"]["saguaro-ar"] == {"x_llama_fastest": 0.5, "x_saguaro_ar": 1.0}
    assert out["ratios"]["llama-bf16-ar"]["x_saguaro_ar"] == pytest.approx(0.8)
    assert "x llama.cpp fastest" in text


def test_cpu_description_names_the_generation_and_simd_flags():
    info = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t\t: fpu avx f16c fma avx2 sse4_2\n"
    d = bp.cpu_description(info)
    assert d["model"] == "AMD EPYC (family 25 model 1: Zen 3)"
    assert d["simd"] == ["avx", "avx2", "fma", "f16c"]


def test_bench_sd_reads_the_measured_llama_rows(tmp_path):
    assert lc.measured_reference(tmp_path) is None  # not run yet
    (tmp_path / "bench_peers.json").write_text(
        '{"cpu": {"summary": "AMD EPYC, 2 cores"}, "threads": 1, '
        '"labels": {"llama-q4-ar": "llama.cpp AR, 1.5B Q4_K_M", "saguaro-ar": "Saguaro AR"}, '
        '"summary": {"llama-q4-ar": {"tok_s_median": 20.5}, "saguaro-ar": {"tok_s_median": 9.0}}}')
    ref = lc.measured_reference(tmp_path)
    assert ref["rows"] == {"llama.cpp AR, 1.5B Q4_K_M": 20.5} and ref["cpu"] == "AMD EPYC, 2 cores"


def test_a_run_with_stand_in_programs_writes_the_table(tmp_path, monkeypatch):
    """The whole path from the cached build to results/bench_peers.{md,json}, with shell scripts standing in for
    the llama.cpp programs (they print the recorded samples), so nothing is built or loaded."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))
    build = lc.build_location()
    (build.build / "bin").mkdir(parents=True)
    logs = {"llama-completion": COMPLETION_LOG, "llama-speculative-simple": SPECULATIVE_LOG, "llama-quantize": ""}
    for tool, log in logs.items():
        (tmp_path / f"{tool}.log").write_text(log)
        script = build.tool(tool)
        script.write_text(f"#!/bin/sh\necho 'def f(): pass'\ncat '{tmp_path / f'{tool}.log'}' >&2\n")
        script.chmod(0o755)
    files = {k: tmp_path / f"{k}.gguf" for k in ("target-q4", "draft-q4")}
    for path in files.values():
        path.write_bytes(b"GGUF")
    monkeypatch.setattr(bp, "model_files", lambda build, keys: files)
    monkeypatch.setattr(bp, "prepare_prompts", lambda tok, names, n: [
        bp.Prompt("humaneval", i, "def f():", list(range(143)), "<|im_start|>user\ndef f():") for i in range(n)])
    import saguaro.loading
    monkeypatch.setattr(saguaro.loading, "load_tokenizer", lambda name, progress=False: None)
    out = tmp_path / "results"
    assert bp.main(["--only", "llama-q4-ar,llama-q4-spec", "--skip-build", "--prompts", "2", "--out", str(out)]) == 0
    import json
    payload = json.loads((out / "bench_peers.json").read_text())
    assert payload["summary"]["llama-q4-ar"]["tok_s_median"] == pytest.approx(3 / 0.94587)
    assert payload["summary"]["llama-q4-spec"]["acceptance_rate"] == pytest.approx(37 / 48)
    assert payload["llama_fastest"] == "llama-q4-spec" and "rows_not_run" not in payload
    assert payload["summary"]["llama-q4-ar"]["prompt_tokens_equal"] == 0  # 3 tokens there, 143 here
    assert payload["summary"]["llama-q4-spec"]["prompt_tokens_equal"] == 2
    assert "--spec-draft-n-max 4" in payload["commands"]["llama-q4-spec"]
    md = (out / "bench_peers.md").read_text()
    assert "llama.cpp speculative, Q4_K_M pair, draft 4" in md and "x llama.cpp fastest" in md
    busy = max(s["loadavg_1m_after"] for s in payload["summary"].values()) > payload["cpu"]["cores"]
    assert ("above 1 per core" in md) == busy and ("at most 1 per core" in md) == (not busy)  # says what it saw


def test_a_saguaro_row_this_cpu_cannot_run_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    def refuse(name, options, prompts, args):
        raise ValueError("int8/int4 weights need the fast path")
    monkeypatch.setattr(bp, "run_engine", refuse)
    monkeypatch.setattr(bp, "prepare_prompts", lambda tok, names, n: [bp.Prompt("humaneval", 0, "x", [1], "x")])
    import saguaro.loading
    monkeypatch.setattr(saguaro.loading, "load_tokenizer", lambda name, progress=False: None)
    assert bp.main(["--only", "saguaro-sd,saguaro-ssd", "--prompts", "1", "--out", str(tmp_path)]) == 0
    import json
    payload = json.loads((tmp_path / "bench_peers.json").read_text())
    assert set(payload["rows_failed"]) == {"saguaro-sd", "saguaro-ssd"} and payload["summary"] == {}
    assert "Not run here: Saguaro SD K=4 (adaptive)" in (tmp_path / "bench_peers.md").read_text()


def test_int4_target_rows_quantize_the_target_only():
    args = bp.parse_args([])
    rows = {r.key: r for r in bp.ROWS}
    for key, mode in (("saguaro-q4-ar", "ar"), ("saguaro-q4-sd", "sd"), ("saguaro-q4-ssd", "ssd")):
        options = bp.saguaro_options(rows[key], args)
        assert options["mode"] == mode and options["target_weights"] == "int4"
        assert "int4 target" in bp.saguaro_label(rows[key], args) or key.endswith("-ar")
        plain = bp.saguaro_options(rows[key.replace("-q4", "")], args)
        assert "target_weights" not in plain and plain["mode"] == mode
    assert bp.saguaro_options(rows["saguaro-q4-sd"], args)["draft_weights"] == "int4"


def test_the_memory_rows_on_a_tiny_pair(tmp_path, monkeypatch):
    """--memory runs every memory row in fresh processes on a tiny pair, and writes the table and the JSON."""
    import json

    import torch

    from benchmarks.peer_memory import MEMORY_ROWS
    from saguaro.backends.cpu_kernels import build as kernels
    from tests.tiny import perturbed, save_hf, tiny_model
    if not kernels.available():
        pytest.skip("needs the CPU kernels (AVX2 or better)")
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))
    target = tiny_model(seed=6, vocab=512, layers=2, hidden=256, sharpness=4.0)
    target_dir = save_hf(target, tmp_path / "target", torch.bfloat16)
    draft_dir = save_hf(perturbed(target, 0.2), tmp_path / "draft", torch.bfloat16)
    monkeypatch.setattr(bp, "prepare_prompts", lambda tok, names, n: [bp.Prompt("humaneval", 0, "x", [5, 9, 2], "x")])
    out = tmp_path / "results"
    assert bp.main(["--target", str(target_dir), "--draft", str(draft_dir), "--draft-weights", "int4",
                    "--draft-vocab", "256", "--only",
                    "saguaro-ar", "--memory", "--prompts", "1", "--max-tokens", "4", "--threads", "1",
                    "--out", str(out)]) == 0
    memory = json.loads((out / "bench_peers.json").read_text())["memory"]
    assert list(memory) == [key for key, _, _ in MEMORY_ROWS]
    for key, row in memory.items():
        assert "error" not in row, row
        assert row["rss_gb"] > 0.05 and row["load_s"] > 0 and row["first_load_s"] > 0
        assert row["options"]["kv_cache_tokens"] == 4096 and row["options"]["max_model_len"] == 4096
        assert row["processes"] == (2 if key == "mem-ssd" else 1)  # SSD's speculator is a process of its own
    assert memory["mem-int4"]["options"]["target_weights"] == "int4"
    assert memory["mem-ssd"]["options"]["mode"] == "ssd" and memory["mem-bf16"]["options"]["mode"] == "ar"
    # the draft alone: AR of the draft model in the SSD row's draft format
    assert memory["mem-draft"]["model"] == str(draft_dir) and memory["mem-draft"]["options"]["mode"] == "ar"
    assert memory["mem-draft"]["options"]["target_weights"] == memory["mem-ssd"]["options"]["draft_weights"] == "int4"
    assert list((tmp_path / "cache").rglob("*.arena"))  # the second run of each row loads from the arena cache
    md = (out / "bench_peers.md").read_text()
    assert "resident GB" in md and "SSD, bf16 target + int4 draft (2 processes)" in md
    assert "The SSD pair against its target's row plus its draft's" in md


FAKE_COMPLETION = """#!{python}
# stands in for llama-completion: holds about 64 MB resident, then prints llama.cpp's load time line
import sys, time
held = bytearray(64 << 20)
time.sleep(0.3)
sys.stderr.write("0.01.000.000 I common_perf_print:        load time =    1234.50 ms\\n")
"""


def test_llama_memory_rows_read_the_programs_resident_memory(tmp_path, monkeypatch):
    """llama.cpp's memory rows without llama.cpp: a stand-in program holding 64 MB, its statm read while it runs,
    its load time line parsed, and the table's ratio of each Saguaro row to llama.cpp's row of its weights."""
    import sys

    from benchmarks import peer_memory as pm
    build = lc.Build(tmp_path)
    tool = build.tool("llama-completion")
    tool.parent.mkdir(parents=True)
    tool.write_text(FAKE_COMPLETION.format(python=sys.executable))
    tool.chmod(0o755)
    monkeypatch.setattr(bp, "model_files", lambda b, keys: {k: tmp_path / f"{k}.gguf" for k in keys})
    rows = bp.llama_memory(build, bp.Prompt("humaneval", 0, "x", [1], "x"), bp.parse_args(["--threads", "1"]))
    assert list(rows) == [key for key, _, _ in pm.LLAMA_MEMORY_ROWS]
    for key, row in rows.items():
        assert 64e6 < row["rss_gb"] * 1e9 < 1e9 and row["load_s"] == pytest.approx(1.2345), row
        assert row["command"][row["command"].index("-c") + 1] == "4096" and row["command"][row["command"].index("-n") + 1] == "8"
    table = pm.memory_table({"mem-bf16": {"label": "AR, bf16 target", "rss_gb": 0.3},
                             "mem-int8": {"label": "AR, int8 target", "rss_gb": 0.2}, **rows})
    line = next(ln for ln in table.splitlines() if ln.startswith("| AR, bf16 target"))
    assert f"| {0.3 / rows['mem-llama-bf16']['rss_gb']:.2f} " in line
    assert next(ln for ln in table.splitlines() if ln.startswith("| AR, int8 target")).split("|")[3].strip() == "-"


def test_a_failing_or_hanging_program_is_a_row_error(tmp_path):
    from benchmarks import peer_memory as pm
    failing = [sys_python(), "-c", "import sys; sys.exit(3)"]
    hanging = [sys_python(), "-c", "import time; time.sleep(30)"]
    failed = pm.measure_llama({"mem-llama-bf16": failing}, timeout=60.0, log=lambda m: None)
    hung = pm.measure_llama({"mem-llama-q4": hanging}, timeout=1.0, log=lambda m: None)
    assert "exit 3" in failed["mem-llama-bf16"]["error"] and "ran past 1 s" in hung["mem-llama-q4"]["error"]


def sys_python() -> str:
    import sys
    return sys.executable
