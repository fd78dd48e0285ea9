"""The synthetic target/draft pair (benchmarks/synthetic.py) has the properties the GPU benchmarks rely on.

Tiny shape, fp32 (exact greedy, so the tuner's teacher-forced count can be held against the engine's):
- the lookup fires: with no perturbation, the target's greedy text follows the planted permutation;
- with the perturbation, a layer-skip draft's greedy acceptance lies strictly between 0 and 1, and the
  tuner's count of it (benchmarks/synthetic_tune.py) is the engine's, round for round;
- no id outside the subset S is ever the argmax, of the target or of the draft.
"""
import pytest
import torch

from benchmarks.synthetic import layer_skip_draft, prompts, synthetic_pair
from benchmarks.synthetic_tune import engine_metrics, greedy_agreement, greedy_texts, top_guesses

TOKENS = 48


@pytest.fixture(scope="module")
def prompt_ids():
    return prompts(512, 4, 16, seed=1)  # the tiny shape's vocabulary: mostly ids outside S


def test_lookup_follows_the_permutation_without_perturbation(prompt_ids):
    target, _, info = synthetic_pair("tiny", dtype=torch.float32, noise=0.0, rivals=0)
    nxt = dict(zip(info["subset"].tolist(), info["next"].tolist()))
    for text in greedy_texts(target, prompt_ids, TOKENS):
        assert all(b == nxt[a] for a, b in zip(text, text[1:])), text
        assert len(set(text)) > TOKENS // 2  # long cycles: the text does not loop early


def test_layer_skip_draft_agrees_partly(prompt_ids):
    target, draft, info = synthetic_pair("tiny", dtype=torch.float32)
    inside = set(info["subset"].tolist())
    texts = greedy_texts(target, prompt_ids, TOKENS)
    guesses = top_guesses(draft, prompt_ids, texts)
    assert all(t in inside for text in texts for t in text)
    assert all(int(g) in inside for rows in guesses for g in rows[:, 0])
    agreement = greedy_agreement(texts, guesses, k=4)
    assert 0.0 < agreement.acceptance < 1.0
    assert agreement.p_hit > 0.0
    assert agreement.by_position[0] > agreement.by_position[-1]  # deeper drafts are accepted less

    metrics = engine_metrics(target, draft, prompt_ids, TOKENS, mode="sd", num_speculative_tokens=4,
                             adaptive=False)
    rounds = (metrics.accepted_tokens + metrics.rounds) / agreement.tokens_per_round
    assert metrics.acceptance_rate == pytest.approx(agreement.acceptance)
    assert metrics.rounds == pytest.approx(rounds)
    assert metrics.acceptance_by_position == pytest.approx(agreement.by_position)


def test_the_draft_is_the_targets_first_layers():
    target, draft, info = synthetic_pair("tiny", draft_layers=3)
    assert draft.config.num_layers == 3 and info["draft_layers"] == 3
    assert draft.model.model.layers[2] is target.model.model.layers[2]
    assert draft.model.model.embed_tokens is target.model.model.embed_tokens
    assert 0.0 < info["draft_bytes_share"] < 1.0
    assert layer_skip_draft(target, 1).config.num_layers == 1
