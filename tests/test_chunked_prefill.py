"""Chunked prefill: ``max_prefill_tokens`` bounds every step (one long prompt included), prefill chunks
alternate with the running requests' decode rounds, an abort takes effect at the next chunk, and AR, SD
and SSD stay exact (greedy equality with unchunked AR) when prompts are cut into tiny chunks."""
import pytest

from saguaro import LLM, SamplingParams
from saguaro.engine.model_runner import ModelRunner
from tests.tiny import PROMPTS, arriving, greedy_tokens

LONG = [(7 * i + 3) % 64 for i in range(41)]  # a prompt of 41 tokens: 14 chunks of 3
CHUNK = 3


@pytest.fixture(scope="module")
def reference(pair):
    return greedy_tokens(pair[0], PROMPTS + [LONG], 16)


MODES = [
    ("ar", {}),
    ("sd", dict(num_speculative_tokens=3)),
    ("sd-ngram", dict(num_speculative_tokens=3, proposer="ngram")),
    # the process transport runs the same Speculator.prefill behind a pipe (tests/test_ssd.py covers both)
    ("ssd", dict(num_speculative_tokens=3, fan_out=[2, 2, 2, 4], speculator_transport="thread")),
]


def _llm(pair, mode: str, **kw) -> LLM:
    draft = pair[1] if mode in ("sd", "ssd") else None
    return LLM(target=pair[0], draft=draft, mode=mode, block_size=4, max_prefill_tokens=CHUNK, enforce_eager=True,
               **kw)


@pytest.mark.parametrize("name, options", MODES, ids=[m[0] for m in MODES])
def test_greedy_equals_unchunked_ar(pair, reference, name, options):
    """Requests arrive while others decode, so chunks and decode rounds interleave (and SSD's speculator
    prefills chunk by chunk)."""
    with _llm(pair, name.split("-")[0], **options) as llm:
        engine = llm.engine
        seqs = arriving(engine, PROMPTS + [LONG], SamplingParams(max_tokens=16), steps_between=2)
        assert getattr(engine.decoder, "failure", None) is None
        assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
    assert [s.output_ids for s in seqs] == reference


def test_every_step_is_bounded_and_decode_interleaves(pair, monkeypatch):
    fed: list[int] = []
    real = ModelRunner.forward

    def counting(self, items):
        fed.append(sum(len(item.token_ids) for item in items))
        return real(self, items)
    monkeypatch.setattr(ModelRunner, "forward", counting)
    with _llm(pair, "ar") as llm:
        engine = llm.engine
        running = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=40))
        while not running.output_ids:
            engine.step()
        fed.clear()
        long = engine.add_request(LONG, SamplingParams(max_tokens=2))
        gaps, since = [], 0
        while not long.output_ids:
            before = len(running.output_ids)
            engine.step()
            since = 0 if len(running.output_ids) > before else since + 1
            gaps.append(since)
    assert fed and max(fed) <= CHUNK  # the single long prompt too
    assert sum(fed) == len(LONG)
    assert max(gaps) <= 1  # the running request gains a token at least every other step


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_abort_takes_effect_at_the_next_chunk(pair, mode):
    options = dict(num_speculative_tokens=3, fan_out=[1, 1, 1, 2], speculator_transport="thread") if mode == "ssd" \
        else {}
    with _llm(pair, mode, **options) as llm:
        engine = llm.engine
        seq = engine.add_request(LONG, SamplingParams(max_tokens=4))
        engine.step()
        assert 0 < seq.num_cached <= CHUNK
        engine.abort(seq)
        assert seq.finish_reason == "abort" and not engine.has_unfinished
        assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
        after = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8))
        while engine.has_unfinished:
            engine.step()
    assert after.output_ids == greedy_tokens(pair[0], [PROMPTS[1]], 8)[0]
