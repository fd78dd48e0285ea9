"""One request cannot break the others: SamplingParams refuses values the kernels cannot compute with, any
value it accepts samples fine, and a row that still goes wrong (a token id outside the vocabulary) fails that
request alone. Healthy requests beside a fuzzed one finish with exactly the tokens they get alone, in AR, SD
and SSD (tiny fp32 models, eager).

In SSD a seeded sampled request is exact in distribution but not token for token across batches: which of
its speculations hit (and so how its random stream is spent) depends on the batch. Its healthy requests
there are greedy."""
import math

import pytest

pytest.importorskip("hypothesis")  # absent on the GPU machine
from hypothesis import given, settings, strategies as st  # noqa: E402

from saguaro import LLM, SamplingParams  # noqa: E402
from saguaro.sampling.batch import INVALID_TOKEN  # noqa: E402
from tests.tiny import PROMPTS, weak_pair  # noqa: E402

CONTEXT = 32  # bounds what a fuzzed request with a huge max_tokens may run
SAMPLED = dict(max_tokens=10, temperature=0.8, seed=7)
HEALTHY = {"ar": [(PROMPTS[1], dict(max_tokens=10)), (PROMPTS[3], SAMPLED)],
           "ssd": [(PROMPTS[1], dict(max_tokens=10)), (PROMPTS[3], dict(max_tokens=10))]}
HEALTHY["sd"] = HEALTHY["ar"]
MODES = {"ar": {}, "sd": dict(num_speculative_tokens=3),
         "ssd": dict(num_speculative_tokens=3, fan_out=[2, 2, 2, 4], speculator_transport="thread")}


@pytest.fixture(scope="module", params=list(MODES))
def engine(request):
    target, draft = weak_pair()
    mode = request.param
    with LLM(target=target, draft=None if mode == "ar" else draft, mode=mode, block_size=4, max_model_len=CONTEXT,
             max_prefill_tokens=5, enforce_eager=True, **MODES[mode]) as llm:
        healthy = HEALTHY[mode]
        alone = [llm.generate(p, SamplingParams(**kw))[0].token_ids for p, kw in healthy]
        yield llm, healthy, alone
        assert getattr(llm.engine.decoder, "failure", None) is None


def _run(llm, requests, extra: tuple[list[int], SamplingParams] | None = None, poison=None):
    """The healthy ``requests``, plus ``extra`` between them; ``poison(seq, tokens)`` may corrupt a round."""
    engine = llm.engine
    healthy = [engine.add_request(requests[0][0], SamplingParams(**requests[0][1]))]
    other = engine.add_request(*extra) if extra else None
    healthy.append(engine.add_request(requests[1][0], SamplingParams(**requests[1][1])))
    if poison is not None:
        real = engine.decoder.decode
        engine.decoder.decode = lambda seqs: [poison(s, t) for s, t in zip(seqs, real(seqs))]
    try:
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.decoder.__dict__.pop("decode", None)
    assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
    return [s.output_ids for s in healthy], other


FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 5e-324, 1e-45, 1e-38, 1e-7, 2.0, 1e308, 3.4e38,
                                                 -1e-45, math.nan, math.inf, -math.inf]))
INTS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([-2, -1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63,
                                                              2**64 - 1, 2**64, -2**63, -2**63 - 1]))
ANY = st.one_of(FLOATS, INTS, st.booleans(), st.none(), st.text(max_size=3), st.lists(INTS, max_size=2))
VALID_FIELDS = {  # accepted values, extremes first
    "temperature": st.one_of(st.sampled_from([0.0, -0.0, 5e-324, 1e-45, 1e-38, 1e-7, 2.0, 1e308, 3.4e38]),
                             st.floats(0, 1e308)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-45, 1e-7, 0.5, 1.0]), st.floats(0, 1, exclude_min=True)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 63, 64, 65, 2**31 - 1]), st.integers(-1, 2**31 - 1)),
    "max_tokens": st.one_of(st.integers(1, 12), st.sampled_from([2**31, 2**63 - 1, 10**30])),
    "seed": st.one_of(st.none(), st.sampled_from([-2**63, 0, 2**63 - 1]), st.integers(-2**63, 2**63 - 1)),
    "stop": st.lists(st.text(max_size=4), max_size=3), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 2**63 - 1), max_size=2), "skip_special_tokens": st.booleans(),
}
VALID = st.fixed_dictionaries(VALID_FIELDS)
# accepted settings, or accepted ones with one field set to anything at all (mostly refused)
FUZZED = st.one_of(VALID, st.tuples(VALID, st.sampled_from(sorted(VALID_FIELDS)), ANY).map(
    lambda t: {**t[0], t[1]: t[2]}))
@settings(max_examples=10, deadline=None, derandomize=True)
@given(fields=FUZZED)
def test_a_fuzzed_request_leaves_the_others_exact(engine, fields):
    llm, healthy, alone = engine
    try:
        params = SamplingParams(**fields)
    except ValueError:
        params = None  # refused with a clear error before it reaches the engine
    outputs, other = _run(llm, healthy, (PROMPTS[0], params) if params else None)
    assert outputs == alone
    if other is not None:
        vocab = llm.engine.target.config.vocab_size
        assert other.finished and other.finish_reason in ("stop", "length")
        assert all(0 <= t < vocab for t in other.output_ids)


@pytest.mark.parametrize("fields, word", [
    (dict(temperature=math.nan), "temperature"), (dict(temperature=-1e-45), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=math.nan), "top_p"),
    (dict(top_k=2**63), "top_k"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(stop=[3]), "stop"), (dict(stop=1.5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=None), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(skip_special_tokens=None), "skip_special_tokens"),
])
def test_sampling_params_refuse_what_kernels_cannot_compute(fields, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**fields)


def test_sampling_params_extremes_that_are_accepted():
    assert SamplingParams(top_k=-1).top_k == 0  # -1 disables top-k, as vLLM
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert not SamplingParams(temperature=1e-45).greedy


def test_a_bad_row_fails_its_request_alone(engine):
    """A round that hands one request a token outside the vocabulary (what the sampler gives a row it cannot
    sample) finishes that request with an error; the others go on, exact."""
    llm, healthy, alone = engine
    victim = llm.engine.add_request  # the extra request is the victim

    def poison(seq, tokens):
        return [INVALID_TOKEN] if seq is bad and len(seq.output_ids) >= 2 else tokens
    bad = victim(PROMPTS[0], SamplingParams(max_tokens=12))
    outputs, _ = _run(llm, healthy, poison=poison)
    assert outputs == alone
    assert bad.finish_reason.startswith("error") and "valid token" in bad.finish_reason
    assert len(bad.output_ids) == 2
