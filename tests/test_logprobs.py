"""Logprobs (and prompt logprobs for echo) in fp32: AR, SD and SSD equal each other and transformers.

A tiny random qwen2 checkpoint is saved with ``save_pretrained`` and loaded by saguaro; transformers
scores the same token sequences, so every reported logprob and top-N list is checked against an
independent implementation of the model. A token accepted from a draft takes its logprob from the
verification pass's row, so SD and SSD must agree with AR and with transformers to float tolerance.
"""
from dataclasses import replace

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.loading import load_model
from tests.processor_reference import reference_logits
from tests.test_loading_hf import VOCAB, _save_tiny
from tests.tiny import truncated

PROMPTS = [[5, 9, 13, 17, 21], [3, 3, 40, 2, 11, 60, 1], [7, 8]]
TOP = 5
N_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    ref = _save_tiny("qwen2", directory)
    with torch.no_grad():  # peakier next-token distributions, so that drafts are accepted now and then
        ref.lm_head.weight.mul_(25.0)
    ref.save_pretrained(directory)
    return ref, load_model(directory, progress=False)


def modes(loaded, **options):
    draft = truncated(loaded, 1)
    yield "ar", LLM(loaded, block_size=4, **options)
    yield "sd", LLM(target=loaded, draft=draft, mode="sd", num_speculative_tokens=3, block_size=4, **options)
    yield "ssd", LLM(target=loaded, draft=draft, mode="ssd", num_speculative_tokens=3, fan_out=[2, 2, 2, 4],
                     block_size=4, worker_timeout_s=60, **options)


CASES = {
    "greedy": SamplingParams(max_tokens=N_TOKENS, logprobs=TOP),
    "sampled": SamplingParams(max_tokens=N_TOKENS, logprobs=TOP, temperature=1.0, seed=3),
    "processors": SamplingParams(max_tokens=N_TOKENS, logprobs=TOP, presence_penalty=1.0, logit_bias={4: 2.0},
                                 repetition_penalty=1.2),
}


@pytest.fixture(scope="module")
def outputs(checkpoint):
    results = {}
    for mode, llm in modes(checkpoint[1]):
        with llm:
            for name, params in CASES.items():
                results[mode, name] = llm.generate(PROMPTS, [replace(params) for _ in PROMPTS])
            if mode == "sd":
                results["acceptance"] = llm.spec_metrics(results[mode, "greedy"]).acceptance_rate
    return results


def transformers_rows(ref, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(output), V] log-softmax of transformers' logits at the output positions, after the processors."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].double()
    rows = [reference_logits(logits[j], prompt, output[:j], params, []) for j in range(len(output))]
    return torch.log_softmax(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("name", list(CASES))
def test_logprobs_equal_across_modes_and_transformers(checkpoint, outputs, name):
    ref = checkpoint[0]
    params = CASES[name]
    for mode in ("ar", "sd", "ssd"):
        for prompt, out, ar in zip(PROMPTS, outputs[mode, name], outputs["ar", name]):
            assert len(out.logprobs) == len(out.token_ids) == N_TOKENS
            if name != "sampled":  # greedy: every mode emits the same tokens
                assert out.token_ids == ar.token_ids, mode
            expected = transformers_rows(ref, prompt, out.token_ids, params)
            for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
                assert entry.token == token
                assert entry.logprob == pytest.approx(float(expected[j, token]), abs=2e-4), (mode, j)
                top = torch.topk(expected[j], TOP)
                assert [t for t, _ in entry.top] == top.indices.tolist(), (mode, j)
                assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=2e-4)
    assert 0 < outputs["acceptance"]  # some tokens came from drafts, scored on the verification pass's rows


def test_prompt_logprobs_with_no_output(checkpoint):
    """echo with max_tokens 0: the prompt's logprobs only, over several prefill chunks, in every mode."""
    ref, loaded = checkpoint
    prompt = [(7 * i + 3) % VOCAB for i in range(13)]
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    for mode, llm in modes(loaded, max_prefill_tokens=5):  # three chunks
        with llm:
            out = llm.generate([prompt], params)[0]
            again = llm.generate([prompt], replace(params, max_tokens=2, logprobs=1))[0]
        assert out.token_ids == [] and out.finish_reason == "length" and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt) and len(again.logprobs) == 2
        for j, entry in enumerate(out.prompt_logprobs[1:]):
            assert entry.token == prompt[j + 1]
            assert entry.logprob == pytest.approx(float(expected[j, prompt[j + 1]]), abs=2e-4), (mode, j)
            assert [t for t, _ in entry.top] == torch.topk(expected[j], 3).indices.tolist()
        assert again.prompt_logprobs == out.prompt_logprobs or all(
            a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            for a, b in zip(again.prompt_logprobs[1:], out.prompt_logprobs[1:]))


@pytest.mark.parametrize("kwargs, message", [(dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt"),
                                             (dict(max_tokens=0), "max_tokens")])
def test_bad_logprob_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)

