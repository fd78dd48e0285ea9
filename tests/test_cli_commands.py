"""Every ``saguaro`` subcommand end to end, as a user runs it: a real process (``python -m saguaro.cli``) on tiny
models saved as HF directories, with a timeout; exit status 0 and the output the command exists for.

``bench`` runs every script in benchmarks/ at smoke sizes; what the figures mean is each benchmark's own tests'
business (tests/test_bench_*.py), here only that the command runs and writes its report.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.loading import MODELS
from tests.eagle_heads import random_head_dir
from tests.tiny import PROMPTS, greedy_tokens, perturbed, save_hf, tiny_model

REPO = Path(__file__).resolve().parents[1]


def saguaro(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``saguaro ARGS`` from the repository root (``bench`` reads benchmarks/ there), with ``env`` added to the
    environment; fail on a non-zero exit unless not ``check``."""
    done = subprocess.run([sys.executable, "-m", "saguaro.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert not check or done.returncode == 0, \
        f"saguaro {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=3, layers=4, sharpness=3.0)
    return target, perturbed(target, 0.3)  # a draft that agrees with the target only partly


@pytest.fixture(scope="module")
def dirs(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return save_hf(pair[0], root / "target"), save_hf(pair[1], root / "draft")


def test_models_lists_the_registry():
    out = saguaro("models").stdout
    for name in MODELS:
        assert any(line.startswith(name) and ("installed" in line or "missing" in line) for line in out.splitlines())


def test_generate_ar_sd_ssd_give_the_same_greedy_tokens(dirs, pair):
    target, draft = dirs
    expected = greedy_tokens(pair[0], [[1, 2, 3]], 12)[0]
    common = ["--prompt", "t1 t2 t3", "--max-tokens", "12", "--dtype", "float32", "--json"]
    ar = json.loads(saguaro("generate", "--model", target, *common).stdout)
    assert ar["token_ids"] == expected and ar["finish_reason"] == "length" and ar["text"].startswith("t")
    for mode, extra in (("sd", []), ("ssd", ["--fan-out", "1,1,2"])):
        out = json.loads(saguaro("generate", "--target", target, "--draft", draft, "--mode", mode, "--k", "2",
                                 *extra, *common).stdout)
        assert out["token_ids"] == expected, mode
        assert out["spec"]["drafted_tokens"] > 0 and out["spec"]["rounds"] > 0, mode
    streamed = saguaro("generate", "--model", target, "--prompt", "t1 t2 t3", "--chat", "--stream",
                       "--max-tokens", "6", "--dtype", "float32")
    assert len(streamed.stdout.split()) == 6 and "[ar] 6 tokens" in streamed.stderr


def test_demo_runs_its_three_modes_on_a_given_pair(dirs):
    target, draft = dirs
    out = saguaro("demo", "--target", target, "--draft", draft, "--prompts", "1", "--max-tokens", "8",
                  "--k", "2", "--ssd-fan-out", "1,1,2", "--draft-vocab", "0").stdout
    for row in ("AR (1 core)", "SD K<=2 adaptive (1 core)", "SSD K<=2 adaptive (2 cores)"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert "Greedy outputs identical to AR" in out and "SSD output for the first prompt" in out


def test_info_names_the_cpu_and_each_models_path(dirs):
    target, draft = dirs
    out = saguaro("info", "--target", target, "--draft", draft, "--draft-vocab", "0").stdout
    assert out.startswith("CPU: ") and "kernel tiers this CPU executes" in out
    assert f"target {target}: bf16;" in out and f"draft  {draft}: int4;" in out
    assert "one-core bandwidth" in out
    line = next(x for x in out.splitlines() if x.startswith("expected footprint of the demo's SSD (2 processes)"))
    assert "(4096 tokens)" in line and "2 x " in line


def test_the_footprint_adds_arenas_kv_caches_and_a_runtime_per_process(dirs):
    from saguaro.backends.cpu_kernels.model import pass_bytes
    from saguaro.info import footprint, model_line
    from saguaro.loading import load_model
    from saguaro.models.draft_format import DraftFormat
    target, draft = (str(d) for d in dirs)
    models = [model_line("target", target, DraftFormat()), model_line("draft", draft, DraftFormat("int4"))]
    cfg = load_model(target, torch.bfloat16, progress=False).config
    assert models[0].bytes_per_token == pass_bytes(cfg, "bf16")
    assert models[0].kv_bytes_per_token == cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, bf16
    arenas = models[0].bytes_per_token + models[1].bytes_per_token
    kv = (models[0].kv_bytes_per_token + models[1].kv_bytes_per_token) * 100
    line = footprint(models, runtime_bytes=10**9, context=100)
    assert f"about {(arenas + kv + 2 * 10**9) / 1e9:.2f} GB" in line and f"{arenas / 1e9:.2f} GB packed" in line


def healthy(port: int) -> bool:
    from tests.serving import http
    try:
        return http(f"http://127.0.0.1:{port}/health")[0] == 200
    except urllib.error.URLError:  # not listening yet
        return False


def test_serve_answers_a_completion_and_a_chat(dirs, pair):
    openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
    from saguaro.workers.process import free_port
    target, _ = dirs
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "saguaro.cli", "serve", "--model", str(target), "--port",
                             str(port), "--dtype", "float32", "--served-model-name", "tiny"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not healthy(port):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model="tiny", prompt="t1 t2 t3", max_tokens=8, temperature=0)
        expected = pair[0].tokenizer.decode(greedy_tokens(pair[0], [[1, 2, 3]], 8)[0])
        assert completion.choices[0].text == expected and completion.usage.completion_tokens == 8
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t4 t5"}],
                                              max_tokens=5, temperature=0)
        assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content.split()) == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            log, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    # a graceful stop: the application shut down, then uvicorn re-raised SIGTERM (exit by that signal)
    assert proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in log


def test_calibrate_measures_and_writes_a_profile(dirs, tmp_path):
    target, draft = dirs
    out = saguaro("calibrate", "--target", target, "--draft", draft, "--dtype", "float32", "--k", "2",
                  "--temperatures", "0", "--prompts", "1", "--max-tokens", "8", "--batch", "2", "--max-rows", "8",
                  "--max-batch", "2", "--core", "-1", "--no-contention", "--no-save", "--json", tmp_path / "p.json")
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["k"] == 2 and profile["timing"]["verify_s"] > 0
    assert "num_speculative_tokens='auto' would pick K=" in out.stdout


def test_calibrate_an_int4_target_for_the_engine_that_runs_it(dirs, tmp_path):
    """--target-weights int4: the target timed and run on the int4 kernels, the profile saved under its own key,
    and an engine with that target and draft reads it (not the defaults); a quantized target off the fast path
    is refused."""
    target, draft = dirs
    env = {"SAGUARO_CACHE": str(tmp_path / "cache")}
    out = saguaro("calibrate", "--target", target, "--draft", draft, "--target-weights", "int4", "--draft-weights",
                  "int4", "--k", "2", "--temperatures", "0", "--prompts", "1", "--max-tokens", "8", "--batch", "2",
                  "--max-rows", "8", "--max-batch", "2", "--core", "-1", "--no-contention", env=env)
    saved = next((tmp_path / "cache" / "profiles").glob("*@int4__*.json"))
    assert str(saved) in out.stdout
    profile = json.loads(saved.read_text())
    assert profile["target_weights"] == "int4" and profile["draft_format"] == "int4"
    tier = profile["kernels"]  # the kernel tier its timings ran on
    assert tier in ("avx512", "avx2", "portable")
    saguaro("calibrate", "--target", target, "--draft", draft, "--target-weights", "int4", "--draft-weights", "int4",
            "--timing-only", "--max-rows", "8", "--core", "-1", "--no-contention", env=env)
    assert json.loads(saved.read_text())["kernels"] == tier
    code = ("import sys; from saguaro.config import Config; from saguaro.calibration.resolve import pair_profile; "
            "cfg = Config(target=sys.argv[1], draft=sys.argv[2], mode='sd', num_speculative_tokens=2, "
            "target_weights=sys.argv[3], draft_weights='int4', dtype='bfloat16'); p = pair_profile(cfg, 2); "
            "print(p.default, p.target_weights, p.kernels or '-')")
    # an engine on another tier reads the profile with its own tier's row curves
    other = {} if tier == "portable" else {"SAGUARO_CPU_TIER": "portable"}
    for weights, tiers, expected in (("int4", {}, f"False int4 {tier}"), ("bf16", {}, "True bf16 -"),
                                     ("int4", other, f"False int4 {'portable' if other else tier}")):
        read = subprocess.run([sys.executable, "-c", code, target, draft, weights], capture_output=True, text=True,
                              env={**os.environ, **env, **tiers}, timeout=300)
        assert read.stdout.split() == expected.split(), read.stderr
    refused = saguaro("calibrate", "--target", target, "--draft", draft, "--target-weights", "int4", "--dtype",
                      "float32", "--no-save", check=False)
    assert refused.returncode != 0 and "--target-weights int4 runs on the CPU kernels" in refused.stderr


def test_train_head_saves_a_head_that_loads_everywhere_and_drafts_exactly(dirs, pair, tmp_path):
    """A few steps on the tiny target; the head is one Llama layer to transformers, and in SD it drafts with
    greedy output equal to AR (fp32)."""
    import transformers
    target, _ = dirs
    out = saguaro("train-head", "--target", target, "--out", tmp_path, "--train-tokens", "64", "--seq-len", "16",
                  "--steps", "3", "--ttt-steps", "3", "--draft-vocab", "48", "--top-k", "4", "--checkpoint-every", "2",
                  "--threads", "1").stdout
    assert f"head saved to {tmp_path / 'head'}" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == 3 and len(report["held_out"]["per_step_agreement"]) == 3
    assert transformers.AutoConfig.from_pretrained(tmp_path / "head").num_hidden_layers == 1
    assert torch.load(tmp_path / "trainer.pt", weights_only=False)["settings"]["ttt_steps"] == 3
    expected = greedy_tokens(pair[0], PROMPTS, 12)
    with LLM(target=str(target), draft=str(tmp_path / "head"), mode="sd", num_speculative_tokens=3, block_size=4,
             dtype="float32") as llm:
        assert llm.engine.decoder.proposer.head.config.draft_vocab_size == 48
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12))] == expected


# -- bench: every script in benchmarks/ at smoke sizes ---------------------------------------------------------------
def bench_cases(target: Path, draft: Path, head: str, out: Path) -> dict[str, tuple[list, str]]:
    """Per benchmark: its arguments and the report it writes under ``out``."""
    pair = ["--target", target, "--draft", draft]
    serve = ["--prompts", "1", "--datasets", "humaneval", "--max-tokens", "4", "--out", out]
    return {
        "ar": (["--target", target, *serve, "--batch-sizes", "1", "--skip-hf", "--no-step-costs",
                "--bandwidth-gb", "0.05"], "bench_ar.json"),
        "sd": ([*pair, *serve, "--ks", "2", "--ngram-k", "2", "--skip-hf", "--temperatures", "0",
                "--warmup-tokens", "0"], "bench_sd.json"),
        "ssd": ([*pair, *serve, "--k", "2", "--fan-outs", "uniform", "--skip-two-threads", "--skip-probe",
                 "--transport", "thread", "--warmup-tokens", "0"], "bench_ssd.json"),
        "eagle": ([*pair, *serve, "--k", "2", "--head", head, "--temperatures", "0", "--warmup-tokens", "0"],
                  "bench_eagle.json"),
        "peers": ([*pair, *serve, "--only", "saguaro-ar,saguaro-sd", "--prefill", "16"], "bench_peers.json"),
        "cpu_tiers": ([*pair, "--tiers", "portable", "--n", "64", "--k", "64", "--reps", "1", "--steps", "2",
                       "--out", out], "cpu_tiers.json"),
        "gpu": (["--device", "cpu", "--shapes", "tiny", "--context", "16", "--max-tokens", "4", "--batches", "1",
                 "--sd-k", "2", "--verify-rows", "2", "--tree-rows", "4", "--reps", "1", "--no-hf", "--out", out,
                 "--name", "gpu"], "gpu.json"),
        "gpu_ssd": (["--device", "cpu", "--shape", "tiny", "--prompts", "1", "--prompt-len", "16", "--max-tokens",
                     "4", "--sd-k", "2", "--ssd", "2:uniform", "--reps", "1", "--verify-rows", "2,3",
                     "--tree-rows", "4", "--project", "none", "--out", out, "--name", "gpu_ssd"], "gpu_ssd.json"),
        "serving_itl": (["--model", target, "--mode", "ssd", "--draft", draft, "--prompt-tokens", "64", "--streams",
                         "2", "--chunks", "0,16", "--label", "smoke", "--out", out / "itl"], "itl.json"),
        "tp": ([*pair, "--modes", "ar", "--sizes", "1,2", "--max-tokens", "4", "--out", out], "bench_tp.json"),
        "adapt": ([*pair, *serve, "--modes", "ssd", "--ks", "2", "--max-k", "2", "--temperatures", "0",
                   "--warmup-tokens", "0"], "bench_adapt.json"),
        "adapt_sim": ([*pair, "--max-k", "2", "--max-tokens", "8", "--requests", "2", "--acceptances", "0.5",
                       "--variant", "stay_gain=1.0", "--out", out], "bench_adapt_sim.json"),
        "host_calls": ([*pair, "--batch", "1", "--k", "2", "--fixed-k", "--max-tokens", "4", "--reps", "1", "--out",
                        out], "bench_host_calls.json"),
        "serve_clients": (["--shape", "tiny", "--prompts", "1", "--max-tokens", "4", "--draft-weights", "bf16",
                           "--out", out], "bench_serve_clients.json"),
        "prefill_attention": (["--new", "32", "--cached", "64", "--prompt-tokens", "0", "--out",
                               out / "prefill_attention"], "prefill_attention.json"),
    }


def test_every_benchmark_has_a_smoke_case():
    names = {p.stem.removeprefix("bench_") for p in (REPO / "benchmarks").glob("bench_*.py")}
    assert names == set(bench_cases(Path("t"), Path("d"), "h", Path("o")))


@pytest.mark.parametrize("name", sorted(bench_cases(Path("t"), Path("d"), "h", Path("o"))))
def test_bench_runs_at_smoke_size(name, dirs, pair, tmp_path_factory):
    target, draft = dirs
    head = random_head_dir(pair[0], tmp_path_factory, "midlayer", draft_vocab=48, seed=1)
    out = tmp_path_factory.mktemp(f"bench-{name}")
    args, report = bench_cases(target, draft, head, out)[name]
    saguaro("bench", name, *args, timeout=400)
    assert json.loads((out / report).read_text()), report


@pytest.mark.parametrize("args, message", [
    (["nonesuch"], "benchmark 'nonesuch' not found"),
    (["peers", "--target", "t", "--only", "llama-q4-ar"], "llama.cpp rows run the registry's GGUF pair"),
])
def test_a_benchmark_that_cannot_run_fails(args, message):
    done = subprocess.run([sys.executable, "-m", "saguaro.cli", "bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr
