"""A target sharded over 2 ranks (spawned processes, Gloo) generates what one device does.

Greedy AR, SD and SSD at TP=2 equal TP=1 token for token in fp32; SD at T > 0 samples the
target's law (threshold from tests/stats.py for this n, with a negative control); a rank that
dies or hangs mid-generation fails every request with a clear error in bounded time, and
``close()`` leaves no process behind.
"""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.parallel import TensorParallelError
from saguaro.parallel.groups import TPGroups
from tests.dist_harness import measure
from tests.tiny import PROMPTS, greedy_tokens, perturbed, save_hf, tiny_model

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference(pair):
    return greedy_tokens(pair[0], PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["sd", "ssd"])  # AR: test_tp_ar_loads_an_hf_directory_by_slice
def test_tp2_greedy_equals_tp1(pair, reference, mode):
    target, draft = pair
    with LLM(target=target, draft=draft, mode=mode, num_speculative_tokens=3, block_size=4, dtype="float32",
             tensor_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        assert llm.engine.target.cache.data.shape[3] == 1  # each rank holds one of the 2 KV heads
    assert [o.token_ids for o in outs] == reference


N_SAMPLES = 10_000  # threshold ~0.106 at m = 256 (tests/stats.py); keeps the test near a minute here


@pytest.fixture(scope="module")
def sampled_pair():
    target = tiny_model(seed=5, vocab=16, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.03)


def _sd(pair):
    return LLM(target=pair[0], draft=pair[1], mode="sd", num_speculative_tokens=2, block_size=4, dtype="float32",
               max_num_seqs=1024, kv_cache_tokens=1024 * 16, tensor_parallel_size=2)


def test_tp2_sd_distribution(sampled_pair):
    with _sd(sampled_pair) as llm:
        tv, threshold = measure(llm, sampled_pair[0], SamplingParams(temperature=1.0), [0, 1], N_SAMPLES)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def test_negative_control_rank0_drops_rank1_logits(sampled_pair, monkeypatch):
    """Rank 0 keeps only its own half of the vocabulary's logits: the same check must fail."""
    gather = TPGroups.gather_last_dim

    def own_half_only(self, x):
        full = gather(self, x)
        if full is not None:
            full[:, x.shape[-1]:] = 0.0
        return full
    monkeypatch.setattr(TPGroups, "gather_last_dim", own_half_only)
    with _sd(sampled_pair) as llm:
        tv, threshold = measure(llm, sampled_pair[0], SamplingParams(temperature=1.0), [0, 1], 2000)
    assert tv >= threshold, f"the wrong gather passed: TV {tv:.4f} < {threshold:.4f}"


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_rank_failure_fails_requests_and_leaves_no_process(pair, how):
    llm = LLM(pair[0], block_size=4, dtype="float32", tensor_parallel_size=2, worker_timeout_s=3.0)
    worker = llm._target.workers[0]
    stream = llm.stream(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 1"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    with pytest.raises(TensorParallelError):  # every later request fails at once too
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))
    llm.close()
    assert worker.proc.poll() is not None


def test_tp_ar_loads_an_hf_directory_by_slice(tmp_path, reference, pair):
    """Greedy AR at TP=2 equals TP=1, the target given by path: every rank reads its own slices of the file. The
    whole embedding table (what an EAGLE-3 head reads) is read from the file too."""
    directory = save_hf(pair[0], tmp_path)
    with LLM(str(directory), block_size=4, dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        assert torch.equal(llm._target.embeddings(), pair[0].model.model.embed_tokens.weight)
    assert [o.token_ids for o in outs] == reference


def test_tp_size_that_does_not_divide_is_refused():
    odd = tiny_model(seed=1)
    odd.config.num_heads = 3  # as SmolLM2-135M's 9 heads over 2 ranks
    with pytest.raises(ValueError, match="3 attention heads"):
        LLM(odd, dtype="float32", tensor_parallel_size=2)
    torch.manual_seed(0)


TORCHRUN_SCRIPT = """
import json, sys
from saguaro import LLM, SamplingParams
llm = LLM(sys.argv[1], block_size=4, dtype="float32", tensor_parallel_size=2)  # ranks > 0 serve, then exit here
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=int(sys.argv[3])))
llm.close()
print("TOKENS", json.dumps([o.token_ids for o in outs]))
"""


def test_torchrun_gives_the_same_tokens(tmp_path, reference, pair):
    """``torchrun --nproc-per-node 2`` runs the same code: rank 0 is the engine, rank 1 serves and exits."""
    import json
    import subprocess
    import sys

    from saguaro.workers.process import free_port
    directory = tmp_path / "tiny"
    directory.mkdir()
    save_hf(pair[0], directory)
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(script), str(directory), json.dumps(PROMPTS), str(MAX_TOKENS)]
    # the script lives in tmp_path: it finds this checkout's saguaro whether or not the package is installed
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS"))
    assert json.loads(line.removeprefix("TOKENS ")) == reference
