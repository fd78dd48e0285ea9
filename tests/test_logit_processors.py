"""Logit processors (penalties, logit_bias, min_tokens): the rules, and greedy equality AR == SD == SSD.

Every mode must equal a plain token-by-token reference (tests/processor_reference.py) in fp32: the
verifier applies the processors at each of a pass's positions with the drafts before it counted as
output, so a mistake there (drafts not counted, or counted one position late) changes the tokens.
"""
from dataclasses import replace

import pytest
import torch

import saguaro.sd.sd as sd_module
from saguaro import LLM, SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.sampling.logit_processors import apply_logit_processors
from tests.processor_reference import reference_greedy, reference_logits
from tests.tiny import PROMPTS, every_mode

N_TOKENS = 20
CASES = {
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=2.0),
    "negative-presence": SamplingParams(presence_penalty=-1.0),
    "negative-frequency": SamplingParams(frequency_penalty=-1.5),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "logit_bias": SamplingParams(logit_bias={5: 4.0, 17: -100.0, 40: 2.5}),
    "all": SamplingParams(frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.3, logit_bias={9: 3.0}),
}


def test_rules_hand_computed_with_drafts():
    """Row j of a pass counts the drafts before it, and none after it."""
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0,
                            logit_bias={0: 1.0}, min_tokens=3, stop_token_ids=[3])
    seq = Sequence([1], params)
    seq.output_ids = [2]
    logits = torch.tensor([[1.0, 4.0, 4.0, 4.0, -2.0]]).repeat(3, 1)
    drafts = torch.tensor([[4, 2]])
    out = apply_logit_processors(logits, [seq], [3], drafts)
    # row 0: output [2]; row 1: [2, 4]; row 2: [2, 4, 2] (prompt [1] only for repetition)
    expected = torch.tensor([[2.0, 2.0, 2.0 - 1.5, float("-inf"), -2.0],
                             [2.0, 2.0, 2.0 - 1.5, float("-inf"), -4.0 - 1.5],
                             [2.0, 2.0, 2.0 - 2.5, 4.0, -4.0 - 1.5]])
    torch.testing.assert_close(out, expected)
    for j in range(3):
        ref = reference_logits(logits[j], [1], [2] + drafts[0, :j].tolist(), params, [3])
        torch.testing.assert_close(out[j], ref.float())


def test_rows_without_processors_are_untouched():
    plain, biased = Sequence([1], SamplingParams()), Sequence([1], SamplingParams(logit_bias={1: 1.0}))
    logits = torch.randn(3, 6)
    assert apply_logit_processors(logits, [plain, plain], [1, 2]) is logits
    out = apply_logit_processors(logits, [plain, biased], [2, 1])
    torch.testing.assert_close(out[:2], logits[:2])
    torch.testing.assert_close(out[2], logits[2] + torch.tensor([0, 1.0, 0, 0, 0, 0]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens"),
])
def test_bad_processor_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def outputs(pair):
    """Every case's greedy outputs in every mode, with one engine per mode."""
    results = {}
    for mode, llm in every_mode(*pair):
        with llm:
            for name, params in CASES.items():
                params = replace(params, max_tokens=N_TOKENS)
                results[mode, name] = [o.token_ids for o in llm.generate(PROMPTS, params)]
            results[mode, "plain"] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N_TOKENS))]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_reference_in_every_mode(pair, outputs, name):
    params = CASES[name]
    reference = [reference_greedy(pair[0], p, params, N_TOKENS) for p in PROMPTS]
    assert reference != outputs["ar", "plain"]  # the processor changes the output: the check has teeth
    for mode in ("ar", "sd", "ngram", "ssd"):
        assert outputs[mode, name] == reference, mode


def test_negative_control_drafts_not_counted_fails(pair, monkeypatch):
    """A verifier that scores every position with the history before the pass (drafts not counted) must
    break the equality: the repetition a negative frequency penalty rewards starts inside a pass."""
    monkeypatch.setattr(sd_module, "apply_logit_processors",
                        lambda logits, seqs, rows, drafts: apply_logit_processors(logits, seqs, rows))
    params = replace(CASES["negative-frequency"], max_tokens=N_TOKENS)
    reference = [reference_greedy(pair[0], p, params, N_TOKENS) for p in PROMPTS]
    # a fixed K: adaptive K, chosen from timings, may draft too little for the uncounted drafts to show
    with LLM(target=pair[0], draft=pair[1], mode="sd", num_speculative_tokens=3, block_size=4, adaptive=False) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] != reference


def test_min_tokens_holds_back_stop_tokens_in_every_mode(pair):
    """A stop token the plain output reaches early is never sampled before min_tokens, in any mode."""
    prompt = PROMPTS[1]
    with LLM(pair[0], block_size=4) as llm:
        plain = llm.generate([prompt], SamplingParams(max_tokens=N_TOKENS))[0].token_ids
    stop = plain[2]
    params = SamplingParams(max_tokens=N_TOKENS, min_tokens=8, stop_token_ids=[stop])
    reference = reference_greedy(pair[0], prompt, params, N_TOKENS, end_ids=[stop])
    assert stop not in reference[:8] and len(reference) >= 8
    for mode, llm in every_mode(*pair):
        with llm:
            out = llm.generate([prompt], params)[0]
        assert out.token_ids == reference, mode
        assert out.finish_reason == ("stop" if reference[-1] == stop else "length")


def test_logit_bias_outside_the_vocabulary_is_refused(pair):
    with LLM(pair[0], block_size=4) as llm:
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate([[1, 2]], SamplingParams(logit_bias={64: 1.0}))
        assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids  # the engine goes on
