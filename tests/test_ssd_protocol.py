"""The packed SSD messages round-trip exactly: every row kind, in every order.

Row kinds: greedy (tokens, no distributions), sampled (tokens and their [n, V] distributions),
point mass (an n-gram / random backup), and empty rows (no tokens left in the budget), each a
hit or a miss. A property test draws long batches of random interleavings; the regression case
is the one where a greedy row used to swallow the next sampled row's distributions.
"""
import pytest
import torch

from saguaro.sampling.params import SamplingParams
from saguaro.ssd.protocol import (CMD_PREFILL, Admission, Outcome, RoundRequest, RoundResponse, RowColumns,
                                  SpecRow, pack_request, pack_response, unpack_request, unpack_response)

hypothesis = pytest.importorskip("hypothesis")  # absent on the GPU machine
from hypothesis import given, settings, strategies as st  # noqa: E402

K, V = 3, 7
KINDS = ("greedy", "sampled", "point_mass")


def make_row(kind: str, hit: bool, n: int, seed: int) -> SpecRow:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n,), generator=gen).tolist()
    probs = torch.rand(n, V, generator=gen).softmax(-1) if kind == "sampled" else None
    return SpecRow(hit, tokens, probs, point_mass=kind == "point_mass")


def assert_same(sent: SpecRow, got: SpecRow) -> None:
    assert (got.hit, got.tokens, got.point_mass) == (sent.hit, sent.tokens, sent.point_mass)
    assert (got.probs is None) == (sent.probs is None)
    if sent.probs is not None:
        assert torch.equal(got.probs, sent.probs)


def round_trip(rows: list[SpecRow], **timing) -> RoundResponse:
    return unpack_response(pack_response(RoundResponse(rows, **timing), K), K, V)


def test_greedy_row_does_not_take_the_next_sampled_rows_distributions():
    rows = [make_row("greedy", True, 3, 0), make_row("sampled", True, 3, 1),
            make_row("greedy", True, 3, 2), make_row("sampled", True, 3, 3)]
    for sent, got in zip(rows, round_trip(rows).rows):
        assert_same(sent, got)


row_spec = st.tuples(st.sampled_from(KINDS), st.booleans(), st.integers(0, K), st.integers(0, 2**31))


@settings(max_examples=300, deadline=None)
@given(st.lists(row_spec, min_size=0, max_size=40))
def test_round_trip_any_interleaving(specs):
    rows = [make_row(kind, hit, n, seed) for kind, hit, n, seed in specs]
    back = round_trip(rows, build_s=0.125, respond_s=1e-3, build_steps=2)
    assert len(back.rows) == len(rows)
    for sent, got in zip(rows, back.rows):
        assert_same(sent, got)
    assert (back.build_s, back.respond_s, back.build_steps) == (0.125, 1e-3, 2)


def test_unpacking_checks_blocks_against_flags():
    fields, probs = pack_response(RoundResponse([make_row("sampled", False, 2, 0)]), K)
    with pytest.raises(ValueError, match="flag distributions"):
        unpack_response([fields, probs[:-1]], K, V)
    meta = fields[6:].view(1, -1).clone()
    meta[0, RowColumns.HAS_PROBS] = 0  # the flag, not the presence of data, decides
    with pytest.raises(ValueError, match="flag distributions"):
        unpack_response([torch.cat([fields[:6], meta.reshape(-1)]), probs], K, V)
    with pytest.raises(ValueError, match="K = 4"):
        unpack_response([fields, probs], 4, V)


def test_rows_are_validated():
    with pytest.raises(ValueError, match="point-mass"):
        SpecRow(False, [1], torch.ones(1, V) / V, point_mass=True)
    with pytest.raises(ValueError, match="distributions"):
        SpecRow(False, [1, 2], torch.ones(1, V) / V)
    with pytest.raises(ValueError, match="more than K"):
        pack_response(RoundResponse([SpecRow(False, [1] * (K + 1), None)]), K)


params_spec = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.6, 1.0, 1.7]),
                        top_k=st.integers(0, 50), top_p=st.sampled_from([1.0, 0.9, 0.35]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, V - 1)), max_size=8),
       st.lists(st.tuples(st.lists(st.integers(0, 10**5), min_size=1, max_size=9), params_spec,
                          st.integers(0, 2**62)), max_size=6),
       st.lists(st.integers(0, 10**6), max_size=5), st.sampled_from([1, CMD_PREFILL]))
def test_request_round_trip(outcomes, admissions, releases, command):
    req = RoundRequest([Outcome(100 + i, k, t) for i, (k, t) in enumerate(outcomes)],
                       [Admission(200 + i, toks, p, seed) for i, (toks, p, seed) in enumerate(admissions)],
                       releases, [100 + i for i in range(len(outcomes))], command)
    back = unpack_request(pack_request(req))
    assert (back.outcomes, back.releases, back.order, back.command) == (req.outcomes, req.releases, req.order,
                                                                          req.command)
    for a, b in zip(req.admissions, back.admissions):
        assert (a.seq_id, a.tokens, a.seed) == (b.seq_id, b.tokens, b.seed)
        assert (a.params.temperature, a.params.top_k, a.params.top_p) == (b.params.temperature, b.params.top_k,
                                                                           b.params.top_p)
    assert len(back.admissions) == len(req.admissions)
