"""``saguaro bench peers --prefill`` without llama.cpp: the prompt builder, llama.cpp's prompt-eval line, the
ratios and the table, the llama.cpp side through a stand-in program, and the Saguaro side on a tiny model.
"""
# ruff: noqa: E501  (the recorded log lines stay as llama.cpp printed them)
import json
import sys

import pytest

from benchmarks import bench_peers as bp
from benchmarks import llama_cpp as lc
from benchmarks import peer_prefill as pp
from tests.test_bench_peers import COMPLETION_LOG
from tests.tiny import byte_level_bpe

# `llama-completion -n 1` on an 8,192-token prompt file: the lines of its perf report this benchmark reads.
PROMPT_LOG = """\
0.41.002.101 I common_perf_print:        load time =    1201.77 ms
0.41.002.103 I common_perf_print: prompt eval time =  123456.78 ms /  8192 tokens (   15.07 ms per token,    66.36 tokens per second)
0.41.002.104 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
0.41.002.105 I common_perf_print:       total time =  123500.12 ms /  8193 tokens
"""


@pytest.fixture(scope="module")
def text():
    return pp.source_text()


@pytest.mark.parametrize("n", [1, 7, 512, 2048])
def test_the_prompt_has_exactly_n_tokens_and_survives_the_trip_through_text(text, n):
    tok = byte_level_bpe()  # byte-level BPE, as Qwen's and SmolLM2's
    p = pp.build_prompt(tok, text, n)
    assert len(p.ids) == n and tok.encode(p.text, add_special_tokens=False) == p.ids
    assert not p.text.endswith("\n")  # llama.cpp drops a prompt file's last newline
    assert pp.build_prompt(tok, text, n) == p  # deterministic


@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b", "smollm2-135m"])
def test_real_tokenizers_give_the_longest_prompt(text, model):
    from saguaro.loading import load_tokenizer
    tok = load_tokenizer(model, progress=False)
    p = pp.build_prompt(tok, text, 8192)
    assert len(p.ids) == 8192 and tok.encode(p.text, add_special_tokens=False) == p.ids


def test_the_round_trip_check_is_needed(text):
    """Negative control: a plain cut at N tokens often decodes to text that encodes to other tokens."""
    tok = byte_level_bpe()
    ids = tok.encode(text, add_special_tokens=False)
    naive = [n for n in range(1, 400) if tok.encode(tok.decode(ids[:n]), add_special_tokens=False) != ids[:n]]
    assert naive, "every cut round-trips: the check would be untested"
    for n in naive[:5]:
        p = pp.build_prompt(tok, text, n)
        assert p.start > 0 and len(p.ids) == n and tok.encode(p.text, add_special_tokens=False) == p.ids


def test_prompt_bad_input(text):
    with pytest.raises(ValueError, match="at least 1 token"):
        pp.build_prompt(byte_level_bpe(), text, 0)
    with pytest.raises(ValueError, match="no tokens"):
        pp.build_prompt(byte_level_bpe(), "", 8)


def test_prompt_eval_line_is_parsed():
    pe = lc.parse_prompt_eval(PROMPT_LOG)
    assert (pe.tokens, pe.seconds) == (8192, pytest.approx(123.45678)) and pe.tok_s == pytest.approx(8192 / 123.45678)
    assert lc.parse_prompt_eval(COMPLETION_LOG).tokens == 3
    with pytest.raises(lc.PeerRunError, match="prompt eval"):
        lc.parse_prompt_eval("0.08.894.179 I common_perf_print:        eval time =     945.87 ms /     3 runs\n")


def test_the_context_holds_the_prompt(tmp_path):
    cmd = lc.completion_command(lc.Build(tmp_path), tmp_path / "m.gguf", tmp_path / "p.txt", 1, 2, context=8208)
    assert cmd[cmd.index("-c") + 1] == "8208" and cmd[cmd.index("-n") + 1] == "1"
    default = lc.completion_command(lc.Build(tmp_path), tmp_path / "m.gguf", tmp_path / "p.txt", 8, 1)
    assert default[default.index("-c") + 1] == "4096"  # the decode rows keep their context


def test_ratios_and_table_on_synthetic_rows():
    def runs(rates, n_counted=None):
        return {n: {"prompt_tokens": n_counted or n, "seconds": n / r, "tok_s": r} for n, r in rates.items()}
    rows = {"prefill-llama-bf16": {"label": "llama.cpp, 1.5B BF16", "peer": None, "loadavg_1m_after": 1.5,
                                   "runs": runs({512: 100.0, 2048: 80.0})},
            "prefill-saguaro-bf16": {"label": "Saguaro AR, 1.5B bf16", "peer": "prefill-llama-bf16",
                                     "loadavg_1m_after": 2.5, "runs": runs({512: 120.0, 2048: 60.0})},
            "prefill-llama-smol": {"label": "llama.cpp, SmolLM2-135M Q4_1", "peer": None,
                                   "runs": {512: {"skipped": "beyond the model's context (400)"}}},
            "prefill-saguaro-smol-int4": {"label": "Saguaro AR, SmolLM2-135M int4", "peer": "prefill-llama-smol",
                                          "runs": runs({512: 900.0})},
            "prefill-llama-q4": {"label": "llama.cpp, 1.5B Q4_K_M", "peer": None, "error": "exit 1"}}
    rows["prefill-llama-bf16"]["runs"][2048].update(prompt_tokens=2049, same_count=False)
    x = pp.ratios(rows)
    assert x["prefill-saguaro-bf16"] == {512: pytest.approx(1.2), 2048: pytest.approx(0.75)}
    assert x["prefill-saguaro-smol-int4"] == {512: None}  # its peer was skipped: no ratio
    assert set(x) == {"prefill-saguaro-bf16", "prefill-saguaro-smol-int4"}
    cpu = {"summary": "AMD EPYC, 2 cores; Saguaro's kernels: avx512", "cores": 2}
    md = pp.prefill_table({"lengths": [512, 2048], "rows": rows, "threads": 1, "prefill_chunk": "auto"}, cpu)
    lines = md.splitlines()
    assert any("| 512" in ln and "Saguaro AR, 1.5B bf16" in ln and "| 120.0" in ln and "| 1.20" in ln for ln in lines)
    assert any("| 2048" in ln and "Saguaro AR, 1.5B bf16" in ln and "| 0.75" in ln for ln in lines)
    assert "beyond the model's context (400)" in md and "exit 1" in md
    assert "llama.cpp counted another number of prompt tokens: llama.cpp, 1.5B BF16 at 2048: 2049." in md
    assert "avx512" in md and "1 thread per engine" in md and "load average after each row 1.5-2.5" in md


def test_rows_follow_only_and_the_target():
    assert [r.key for r in pp.chosen_rows(["saguaro-ar", "llama-bf16-ar"], pp.TARGET, llama=True)] == [
        "prefill-llama-bf16", "prefill-saguaro-bf16", "prefill-saguaro-smol-bf16"]
    assert [r.key for r in pp.chosen_rows(["saguaro-ar", "llama-q4-ar"], "/some/dir", llama=False)] == [
        "prefill-saguaro-bf16"]  # SmolLM2 beside the default target only; no llama.cpp rows without llama.cpp
    assert bp.parse_args(["--prefill", "512,2048"]).prefill == [512, 2048]
    assert bp.parse_args([]).prefill == [] and bp.parse_args([]).prefill_chunk == "auto"
    for bad in (["--prefill", "0"], ["--prefill", "64", "--only", "saguaro-sd,llama-q4-spec"]):
        with pytest.raises(SystemExit):
            bp.parse_args(bad)


def fake_gguf(path, context):
    import gguf
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_context_length(context)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


FAKE_COMPLETION = """#!{python}
# stands in for llama-completion: keeps its prompt file and arguments, reports a prompt pass of N = -c minus 16
import json, sys
args = sys.argv[1:]
ctx = int(args[args.index("-c") + 1])
with open({record!r}, "a") as f:
    f.write(json.dumps({{"args": args, "prompt": open(args[args.index("-f") + 1], encoding="utf-8").read()}}) + "\\n")
print("x")
sys.stderr.write("0.41.002.103 I common_perf_print: prompt eval time =   %.2f ms / %5d tokens\\n" % ((ctx - 16) * 10.0, ctx - 16))
"""


def test_llama_rows_through_a_stand_in_program(tmp_path, monkeypatch):
    """The llama.cpp side from the cached build to the JSON: the prompt file holds the builder's text, -c holds it,
    the rate is llama.cpp's own line, a length beyond the file's context is skipped."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))
    build = lc.build_location()
    (build.build / "bin").mkdir(parents=True)
    record = tmp_path / "calls.jsonl"
    for tool in lc.TOOLS:
        build.tool(tool).write_text(FAKE_COMPLETION.format(python=sys.executable, record=str(record)))
        build.tool(tool).chmod(0o755)
    files = {"target-q4": fake_gguf(tmp_path / "t.gguf", 32768)}
    monkeypatch.setattr(bp, "model_files", lambda build, keys: {k: files[k] for k in keys if k in files})
    monkeypatch.setattr(bp, "run_llama", lambda *a: [])  # the decode rows are test_bench_peers.py's business
    monkeypatch.setattr(bp, "prepare_prompts", lambda tok, names, n: [bp.Prompt("humaneval", 0, "x", [1], "x")])
    import saguaro.loading
    import saguaro.loading.registry
    monkeypatch.setattr(saguaro.loading, "load_tokenizer", lambda name, progress=False: byte_level_bpe())
    monkeypatch.setattr(saguaro.loading.registry, "asset_path",
                        lambda entry, progress=False: fake_gguf(tmp_path / "smol.gguf", 100))
    out = tmp_path / "results"
    assert bp.main(["--only", "llama-q4-ar", "--skip-build", "--prompts", "1", "--prefill", "64,300",
                    "--out", str(out)]) == 0
    rows = json.loads((out / "bench_peers.json").read_text())["prefill"]["rows"]
    assert list(rows) == ["prefill-llama-q4", "prefill-llama-smol"]
    q4 = rows["prefill-llama-q4"]["runs"]
    assert q4["64"]["prompt_tokens"] == 64 and q4["64"]["same_count"] and q4["300"]["tok_s"] == pytest.approx(100.0)
    assert rows["prefill-llama-smol"]["runs"]["300"] == {"skipped": "beyond the model's context (100)"}
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    text = pp.source_text()
    assert [c["prompt"] for c in calls] == [pp.build_prompt(byte_level_bpe(), text, n).text for n in (64, 300, 64)]
    assert all(c["args"][c["args"].index("-t") + 1] == "1" for c in calls)
    md = (out / "bench_peers.md").read_text()
    assert "Prompt processing" in md and "llama.cpp, SmolLM2-135M Q4_1" in md


def test_saguaro_rows_on_a_tiny_model(tmp_path, monkeypatch):
    """The Saguaro side end to end on a tiny model: N over the time to first token, a context that holds the
    longest prompt, a length beyond the model's context (512) skipped."""
    from tests.tiny import save_hf, tiny_model
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))
    target_dir = save_hf(tiny_model(seed=6, vocab=512, layers=2, hidden=64), tmp_path / "target")
    monkeypatch.setattr(bp, "prepare_prompts", lambda tok, names, n: [bp.Prompt("humaneval", 0, "x", [5, 9, 2], "x")])
    out = tmp_path / "results"
    assert bp.main(["--target", str(target_dir), "--only", "saguaro-ar", "--prompts", "1", "--max-tokens", "2",
                    "--prefill", "64,600", "--prefill-chunk", "32", "--enforce-eager", "--out", str(out)]) == 0
    prefill = json.loads((out / "bench_peers.json").read_text())["prefill"]
    row = prefill["rows"]["prefill-saguaro-bf16"]
    assert list(prefill["rows"]) == ["prefill-saguaro-bf16"] and row["label"] == "Saguaro AR, target bf16"
    assert row["runs"]["64"]["prompt_tokens"] == 64 and row["runs"]["64"]["tok_s"] > 0
    assert row["runs"]["64"]["tok_s"] == pytest.approx(64 / row["runs"]["64"]["seconds"])
    assert row["runs"]["600"] == {"skipped": "beyond the model's context (512)"}
    assert row["options"]["max_model_len"] == 616 and row["options"]["max_prefill_tokens"] == 32
    assert row["options"]["mode"] == "ar" and row["options"]["threads"] == 1
    assert "Saguaro AR, target bf16" in (out / "bench_peers.md").read_text()
