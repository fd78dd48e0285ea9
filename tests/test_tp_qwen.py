"""The real Qwen2.5-Coder-0.5B over 2 ranks: each reads only its slices of the file, and put together they
equal it; greedy TP=2 equals TP=1 in fp32."""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.loading import MODELS, installed, locate_weights
from saguaro.loading.hf_loader import read_config, read_weights, weight_files
from saguaro.parallel import rank_shard
from saguaro.parallel.shards import read_shard
from tests.tp_ranks import assert_shards_join

NAME = "qwen2.5-coder-0.5b"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not installed(MODELS[NAME]), reason=f"needs {MODELS[NAME].pip_command}")]


def test_qwen_shards_put_together_equal_the_file():
    _, _, directory, _, weights = locate_weights(NAME, torch.float32, progress=False)
    cfg = read_config(directory)
    whole = read_weights(directory, weights)
    parts = [read_shard(weight_files(directory, weights), rank_shard(cfg, 2, r), cfg.vocab_size) for r in range(2)]
    assert_shards_join(whole, parts, cfg)
    total = sum(t.numel() for t in whole.values())
    for part in parts:  # about half each: only norms (and the tied head's duplicate) are whole on every rank
        assert sum(t.numel() for t in part.values()) < 0.51 * total


def test_qwen_tp2_greedy_equals_tp1():
    prompt, params = "def fibonacci(n):", SamplingParams(max_tokens=8)
    outs = []
    for size in (1, 2):
        with LLM(NAME, dtype="float32", kv_cache_tokens=256, tensor_parallel_size=size) as llm:
            outs.append(llm.generate(prompt, params)[0].token_ids)
    assert outs[0] == outs[1]
