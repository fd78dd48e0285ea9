"""Lossless SD: greedy equality with AR, self-draft acceptance 1, mixed batches, rollback."""
import pytest

from saguaro import LLM, SamplingParams
from saguaro.loading import VocabularyMismatchError
from tests.tiny import PROMPTS, greedy_tokens, tiny_model



@pytest.fixture(scope="module")
def ar_outputs(pair):
    return greedy_tokens(pair[0], PROMPTS, 20)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_equals_ar(pair, ar_outputs, k, adaptive):
    target, draft = pair
    llm = LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=k, block_size=4, adaptive=adaptive)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [o.token_ids for o in outs] == ar_outputs
    metrics = llm.spec_metrics(outs)
    assert 0 < metrics.acceptance_rate < 1  # a weaker draft: some rejections exercised
    if not adaptive:  # fixed K drafts K every round
        assert len(metrics.acceptance_by_position) == k
    runner = llm.engine.decoder.proposer.runner
    assert runner.blocks.num_free == runner.blocks.num_blocks
    assert llm.engine.target.blocks.num_free == llm.engine.target.blocks.num_blocks


def test_ngram_sd_equals_ar(pair, ar_outputs):
    llm = LLM(target=pair[0], mode="sd", proposer="ngram", num_speculative_tokens=3, block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [o.token_ids for o in outs] == ar_outputs
    assert llm.spec_metrics(outs).drafted_tokens > 0


def test_self_draft_accepts_everything(pair):
    target = pair[0]
    llm = LLM(target=target, draft=target, mode="sd", num_speculative_tokens=4, block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
    assert llm.spec_metrics(outs).acceptance_rate == 1.0


@pytest.mark.parametrize("adaptive", [False, True])
def test_mixed_batch_matches_alone(pair, adaptive):
    """A seeded request draws the same numbers alone or in a batch: at a fixed K, and adaptive (a seeded request
    chooses its K from its own rounds only)."""
    target, draft = pair
    llm = LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=3, block_size=4, adaptive=adaptive)
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=12),
              SamplingParams(max_tokens=12),
              SamplingParams(temperature=0.6, top_p=0.9, seed=5, max_tokens=12),
              SamplingParams(temperature=1.3, top_k=8, seed=2, max_tokens=12)]
    together = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, together):
        assert llm.generate([prompt], p)[0].token_ids == out.token_ids


def test_draft_with_other_vocabulary_is_refused(pair):
    other = tiny_model(seed=4, vocab=80)
    with pytest.raises(VocabularyMismatchError):
        LLM(target=pair[0], draft=other, mode="sd")


def test_sd_needs_a_draft(pair):
    with pytest.raises(ValueError, match="draft"):
        LLM(target=pair[0], mode="sd")


def test_draft_prefills_the_prompt_with_the_target(pair):
    """The draft catches up on the prompt in the engine's prefill step (counted in the time to first
    token, as in a serving engine), so the first round feeds it only the last prompt token and the first
    sampled one."""
    target, draft = pair
    llm = LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=3, block_size=4, adaptive=False)
    engine, proposer = llm.engine, llm.engine.decoder.proposer
    seq = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8))
    engine.step()  # the prefill
    assert len(seq.output_ids) == 1 and proposer.states[seq.seq_id].num_cached == len(PROMPTS[1]) - 1
    fed = []
    forward = proposer.runner.forward
    proposer.runner.forward = lambda items: fed.append([len(i.token_ids) for i in items]) or forward(items)
    engine.step()  # the first round: K = 3 draft steps
    assert fed[0] == [2] and fed[1:3] == [[1], [1]]
    while engine.has_unfinished:
        engine.step()
    assert proposer.runner.blocks.num_free == proposer.runner.blocks.num_blocks



@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_a_round_reads_from_the_device_once(pair, proposer, monkeypatch):
    """The drafts stay on the draft's device, feed the target pass there, and reach the host together with
    the outcome: one read per round, which on a GPU is the round's one sync (tests/host_reads.py follows
    device values on the CPU)."""
    from saguaro.sd.sd import SDDecoder
    from tests.host_reads import reads_per_call
    draft = pair[1] if proposer == "draft" else None
    with LLM(target=pair[0], draft=draft, mode="sd", proposer=proposer, num_speculative_tokens=3,
             block_size=4) as llm, reads_per_call(monkeypatch, SDDecoder, "decode") as per_round:
        params = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=9, temperature=1.0, seed=3)]
        llm.generate([[1, 2, 3], [5, 9, 13, 17]], params)
    assert per_round and all(n == 1 for n in per_round), per_round
