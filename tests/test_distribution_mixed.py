"""Mixed batches stay exact: greedy and sampled requests, and different sampling settings, side by side.

A server batches whatever its clients send, so one batch mixes greedy requests with sampled ones at
different temperatures, top-k, top-p, seeds and draft budgets (max_tokens). Every request must get
exactly what it would get alone: greedy ones token for token, sampled ones in distribution. The
requests cycle through classes of (settings, prompt); see ``tests/dist_harness.py:measure_mixed``.

The SSD cases run through the real speculator process, so the response is packed and unpacked
(``saguaro/ssd/protocol.py``). The pair is chosen so that a row verified against a neighbour's
draft distributions shows in the law: the draft is the target with 30% weight noise, and classes
have their own prompts. K = 1, vocabulary 8; tokens 1 and 2 come from the first verification
(a just-in-time speculation) and the next one (a hit or a miss: fan-out [1, 2]).

The negative control restores the unpacking the explicit wire format replaced (a row got a block
whenever it was not a point mass and had tokens, so a greedy row took the next sampled row's), with
the old decoder's reading of a row without distributions as a point mass. It must fail the check.
Every engine here runs a fixed K (``adaptive=False``), the paths it names; adaptive K has its own
check, tests/test_distribution_adapt.py.
"""
import pytest

import saguaro.ssd.worker as worker_module
from saguaro import LLM, SamplingParams
from saguaro.ssd.protocol import RoundResponse, RowColumns, SpecRow, _float
from tests.dist_harness import greedy_reference, measure_mixed
from tests.tiny import perturbed, tiny_model

POSITIONS = [1, 2]
N = 24_000
PROMPTS = [[3, 7, 1], [5, 2], [6, 6, 0, 4], [1], [2, 4], [7, 7]]
GREEDY_AND_T1 = [(SamplingParams(), PROMPTS[0]), (SamplingParams(temperature=1.0), PROMPTS[1]),
                 (SamplingParams(), PROMPTS[2]), (SamplingParams(temperature=1.0), PROMPTS[3])]
SETTINGS = [(SamplingParams(), PROMPTS[0]),
            (SamplingParams(temperature=0.6), PROMPTS[1]),
            (SamplingParams(temperature=1.0), PROMPTS[2]),
            (SamplingParams(temperature=1.0, top_p=0.9), PROMPTS[3]),
            (SamplingParams(temperature=1.0, top_k=3), PROMPTS[4]),
            (SamplingParams(temperature=0.8, max_tokens=3), PROMPTS[5])]  # no drafts left for token 2


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=5, vocab=8, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.3)


def engine(pair, mode: str) -> LLM:
    options = dict(block_size=4, max_num_seqs=1024, kv_cache_tokens=1024 * 16, num_speculative_tokens=1)
    if mode == "ssd":  # sampled misses drafted just in time: the rows that carry q (the unpacking's subject)
        options.update(fan_out=[1, 2], miss_strategy="jit")
    return LLM(adaptive=False, target=pair[0], draft=pair[1], mode=mode, **options)


def check(results, classes) -> None:
    for (params, _), result in zip(classes, results):
        if params.greedy:
            assert result is True, "a greedy request in a mixed batch differs from its AR output"
        else:
            tv, threshold = result
            assert tv < threshold, f"{params}: TV {tv:.4f} >= {threshold:.4f}"


@pytest.mark.parametrize("classes", [GREEDY_AND_T1, SETTINGS], ids=["greedy-and-t1", "settings"])
def test_ssd_mixed_batch_distribution(pair, classes):
    with engine(pair, "ssd") as llm:
        results = measure_mixed(llm, pair[0], classes, POSITIONS, N)
        assert llm.engine.decoder.failure is None
        hits = [h for t in llm.engine.decoder.trace for h in t.hits]
    check(results, classes)
    assert 0.05 < sum(hits) / len(hits) < 0.95  # both cache hits and fallback rows were verified


def test_sd_mixed_batch_distribution(pair):
    with engine(pair, "sd") as llm:
        check(measure_mixed(llm, pair[0], SETTINGS, POSITIONS, N), SETTINGS)


def legacy_unpack(frames, k, vocab):
    """The old unpacking, over today's fields: a block went to every row that was not a point mass and held
    tokens, in order, while blocks lasted; a row left without one was verified as a point mass."""
    fields, flat = frames
    build_s, respond_s, steps, n = fields[:4].tolist()
    meta = fields[6:].view(n, RowColumns.TOKENS + k).tolist()
    rows, offset = [], 0
    for m in meta:
        count = m[RowColumns.NUM_TOKENS]
        probs = None
        if offset < flat.numel() and not m[RowColumns.POINT_MASS] and count > 0:
            probs = flat[offset:offset + k * vocab].view(k, vocab)[:count]
            offset += k * vocab
        rows.append(SpecRow(bool(m[RowColumns.HIT]), m[RowColumns.TOKENS:RowColumns.TOKENS + count], probs,
                            bool(m[RowColumns.POINT_MASS]) or probs is None))
    return RoundResponse(rows, _float(build_s), _float(respond_s), steps)


def test_negative_control_old_unpacking_fails(pair, monkeypatch):
    monkeypatch.setattr(worker_module, "unpack_response", legacy_unpack)
    with engine(pair, "ssd") as llm:
        results = measure_mixed(llm, pair[0], GREEDY_AND_T1, POSITIONS, N)
    tv, threshold = results[1]
    assert tv > threshold, f"the check did not catch the old unpacking (TV {tv:.4f} <= {threshold:.4f})"


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_requests_differing_in_one_field_match_alone(pair, mode):
    """Greedy requests that differ only in top-k, top-p, seed or max_tokens, batched with sampled ones, each
    equal their AR output token for token."""
    prompt = PROMPTS[2]
    variants = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, top_k=2),
                SamplingParams(max_tokens=12, top_p=0.5), SamplingParams(max_tokens=12, seed=7),
                SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)]
    sampled = [SamplingParams(temperature=t, max_tokens=12, seed=i) for i, t in enumerate([1.0, 0.6, 1.3])]
    params = [p for pair_ in zip(variants, sampled + sampled) for p in pair_]
    with engine(pair, mode) as llm:
        outs = llm.generate([prompt] * len(params), params)
    for p, out in zip(params, outs):
        if p.greedy:
            assert out.token_ids == greedy_reference(pair[0], prompt, p.max_tokens), p


def test_sd_seeded_requests_differing_in_one_field_match_alone(pair):
    """In SD a seeded sampled request draws only from its own generator, so it matches itself alone token for
    token whatever its neighbours' temperature, top-k, top-p, seed or max_tokens."""
    prompt = PROMPTS[1]
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=10),
              SamplingParams(temperature=0.6, seed=11, max_tokens=10),
              SamplingParams(temperature=1.0, seed=11, max_tokens=10, top_k=3),
              SamplingParams(temperature=1.0, seed=11, max_tokens=10, top_p=0.8),
              SamplingParams(temperature=1.0, seed=12, max_tokens=10),
              SamplingParams(temperature=1.0, seed=11, max_tokens=4),
              SamplingParams(max_tokens=10)]
    with engine(pair, "sd") as llm:
        together = [o.token_ids for o in llm.generate([prompt] * len(params), params)]
        alone = [llm.generate([prompt], p)[0].token_ids for p in params]
    assert together == alone
    assert len({tuple(t) for t in together[:5]}) > 1  # the fields do change the output
