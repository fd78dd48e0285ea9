"""Logit processing (temperature, top-k, top-p) and the per-row sampler."""
from __future__ import annotations

import math

import pytest
import torch

from saguaro.sampling.params import SamplingParams
from saguaro.sampling.processors import probs_from_logits, sampling_tensors
from saguaro.sampling.sampler import inverse_cdf, row_uniforms, sample

try:
    from tests.stats import assert_matches
except ImportError:  # tests/ on sys.path instead of the repository root
    from stats import assert_matches


def _process(weights, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Process one row whose logits are log(weights)."""
    logits = torch.log(torch.tensor([weights], dtype=torch.float32))
    return probs_from_logits(
        logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    )[0]


def _close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- processors


def test_temperature_hand_computed():
    _close(_process([1, 2, 4]), [1 / 7, 2 / 7, 4 / 7])
    s2 = math.sqrt(2)
    _close(_process([1, 2, 4], temperature=2.0), [1 / (3 + s2), s2 / (3 + s2), 2 / (3 + s2)])
    _close(_process([1, 2, 4], temperature=0.5), [1 / 21, 4 / 21, 16 / 21])


def test_top_k_hand_computed():
    _close(_process([1, 2, 3, 4], top_k=2), [0, 0, 3 / 7, 4 / 7])
    _close(_process([1, 2, 3, 4], top_k=1), [0, 0, 0, 1])
    _close(_process([1, 2, 3, 4], top_k=0), [0.1, 0.2, 0.3, 0.4])  # off
    _close(_process([1, 2, 3, 4], top_k=4), [0.1, 0.2, 0.3, 0.4])  # k == V: off
    _close(_process([1, 2, 3, 4], top_k=9), [0.1, 0.2, 0.3, 0.4])  # k > V: off
    # Ties at the cut-off are all kept.
    _close(_process([1, 2, 2, 4], top_k=2), [0, 0.25, 0.25, 0.5])


def test_top_p_hand_computed():
    w = [1, 2, 3, 4]  # probabilities 0.1 0.2 0.3 0.4; mass before each sorted token: 0, .4, .7, .9
    _close(_process(w, top_p=0.35), [0, 0, 0, 1])
    _close(_process(w, top_p=0.5), [0, 0, 3 / 7, 4 / 7])
    _close(_process(w, top_p=0.75), [0, 2 / 9, 3 / 9, 4 / 9])
    _close(_process(w, top_p=0.95), [0.1, 0.2, 0.3, 0.4])
    _close(_process(w, top_p=0.01), [0, 0, 0, 1])  # the top token is always kept
    _close(_process(w, top_p=1.0), [0.1, 0.2, 0.3, 0.4])
    # Nucleus {0.4, 0.2}; the other 0.2s tie with its smallest member and are kept too.
    _close(_process([2, 1, 1, 1], top_p=0.5), [0.4, 0.2, 0.2, 0.2])


def test_top_k_is_applied_before_top_p():
    # top-k=2 leaves (3/7, 4/7); top-p=0.5 then keeps only the top token. (Top-p first would keep two.)
    _close(_process([1, 2, 3, 4], top_k=2, top_p=0.5), [0, 0, 0, 1])


def test_temperature_is_applied_before_top_p():
    # T=0.5 squares the weights: (1, 4, 9, 16)/30; top-p=0.6 keeps 16/30 and 9/30.
    _close(_process([1, 2, 3, 4], temperature=0.5, top_p=0.6), [0, 0, 9 / 25, 16 / 25])


def test_greedy_rows_are_one_hot_at_lowest_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 5.0, 5.0]])
    probs = probs_from_logits(logits, torch.tensor([0.0, 0.0]), torch.tensor([1, 0]), torch.tensor([0.1, 1.0]))
    _close(probs[0], [0, 1, 0, 0])
    _close(probs[1], [0, 0, 1, 0])


def _random_settings(n: int, gen: torch.Generator):
    temperature = torch.rand(n, generator=gen) * 2
    temperature[torch.rand(n, generator=gen) < 0.25] = 0.0
    top_k = torch.randint(0, 12, (n,), generator=gen)
    top_k[torch.rand(n, generator=gen) < 0.4] = 0
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.05
    top_p[torch.rand(n, generator=gen) < 0.4] = 1.0
    return temperature, top_k, top_p


def test_mixed_rows_match_row_by_row():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 200, 37
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[:, 5] = logits[:, 6]  # some exact ties
    temperature, top_k, top_p = _random_settings(n, gen)
    batched = probs_from_logits(logits, temperature, top_k, top_p)
    assert batched.dtype == torch.float32 and batched.shape == (n, vocab)
    torch.testing.assert_close(batched.sum(-1), torch.ones(n), atol=1e-5, rtol=0)
    for i in range(n):
        single = probs_from_logits(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        torch.testing.assert_close(batched[i], single[0], atol=1e-6, rtol=1e-5)
        kept = int((batched[i] > 0).sum())
        if temperature[i] == 0:
            assert kept == 1 and int(batched[i].argmax()) == int(logits[i].argmax())
        elif 0 < top_k[i] < vocab:
            assert kept >= 1 and kept <= top_k[i] + 1  # at most one extra from the tie at index 5/6


def test_top_p_nucleus_is_minimal_without_ties():
    gen = torch.Generator().manual_seed(1)
    n, vocab = 100, 50
    logits = torch.randn(n, vocab, generator=gen) * 2
    top_p = torch.rand(n, generator=gen) * 0.98 + 0.01
    probs = probs_from_logits(logits, torch.ones(n), torch.zeros(n, dtype=torch.long), top_p)
    full = torch.softmax(logits, -1).double()
    for i in range(n):
        kept = probs[i] > 0
        mass = float(full[i][kept].sum())
        assert mass >= top_p[i] - 1e-6  # the nucleus reaches top_p ...
        smallest = float(full[i][kept].min())
        assert mass - smallest < top_p[i] + 1e-6  # ... and would not without its smallest member
        if not kept.all():
            assert float(full[i][~kept].max()) <= smallest  # and it holds the most likely tokens


def test_sampling_tensors_from_params():
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(temperature=1.0)]
    st = sampling_tensors(params)
    temperature, top_k, top_p = st
    assert temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert top_k.tolist() == [0, 5, 0] and top_k.dtype == torch.int64
    assert top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert st.greedy.tolist() == [True, False, False]


# ----------------------------------------------------------------------------- sampler


def test_inverse_cdf_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 1.0, 0.0], [0, 0, 0, 0, 0, 2.0]])
    for u in [0.0, 1e-40, 0.3, 0.5, 1 - 2**-53]:
        tokens = inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert all(probs[i, t] > 0 for i, t in enumerate(tokens.tolist())), (u, tokens)
    # The largest uniform lands on the last token with mass, the smallest on the first.
    top = inverse_cdf(probs, torch.full((3,), 1 - 2**-53, dtype=torch.float64)).tolist()
    assert top == [3, 4, 5]
    assert inverse_cdf(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 2, 5]


def test_greedy_rows_take_argmax_without_randomness():
    probs = torch.tensor([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4], [0.0, 1.0, 0.0]])
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    states = [g.get_state().clone() for g in gens]
    shared = torch.Generator().manual_seed(99)
    shared_state = shared.get_state().clone()
    out = sample(probs, gens, torch.tensor([True, True, True]), shared_generator=shared)
    assert out.tolist() == [1, 2, 1]
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))
    assert torch.equal(shared.get_state(), shared_state)


def test_row_uniforms_streams():
    shared = torch.Generator().manual_seed(5)
    own = torch.Generator().manual_seed(6)
    u = row_uniforms([2, 0, 3, 1], [None, None, own, None], shared_generator=shared)
    ref_shared = torch.rand(3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref_own = torch.rand(3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert u.shape == (4, 3) and u.dtype == torch.float64
    assert u[0, :2].tolist() == ref_shared[:2].tolist() and u[3, :1].tolist() == ref_shared[2:].tolist()
    assert u[2].tolist() == ref_own.tolist()


def test_rows_sharing_a_generator_take_its_numbers_in_row_order():
    """A sequence's branches share its generator (one draw for all of them): row b still gets what drawing its
    own counts[b] numbers, row by row, would give, interleaved with other generators and the shared stream."""
    counts = [1, 2, 0, 1, 3, 1, 2]
    owner = [0, None, 0, 1, 0, None, 1]
    gens = [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)]
    u = row_uniforms(counts, [None if o is None else gens[o] for o in owner],
                     shared_generator=torch.Generator().manual_seed(12))
    refs = [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)]
    shared = torch.Generator().manual_seed(12)
    for b, (c, o) in enumerate(zip(counts, owner)):
        if c:
            expected = torch.rand(c, generator=shared if o is None else refs[o], dtype=torch.float64)
            assert u[b, :c].tolist() == expected.tolist(), b


def test_seeded_row_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(2)
    vocab = 50
    target = torch.softmax(torch.randn(vocab, generator=gen), -1)
    others = torch.softmax(torch.randn(7, vocab, generator=gen), -1)

    def stream(position: int, neighbour_seeds: list[int | None], greedy_neighbours: bool) -> list[int]:
        rows = list(others[: len(neighbour_seeds)])
        rows.insert(position, target)
        probs = torch.stack(rows)
        seeds = list(neighbour_seeds)
        seeds.insert(position, 1234)
        gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
        greedy = torch.full((len(seeds),), greedy_neighbours)
        greedy[position] = False
        shared = torch.Generator().manual_seed(len(seeds))
        return [int(sample(probs, gens, greedy, shared_generator=shared)[position]) for _ in range(30)]

    alone = stream(0, [], False)
    assert stream(3, [1, None, 2, None, None], False) == alone
    assert stream(1, [None, 7, 8], True) == alone
    assert stream(7, [None] * 7, False) == alone
    assert len(set(alone)) > 1


def _test_distribution(vocab: int, seed: int, zeros: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.distributions.Dirichlet(torch.full((vocab,), 0.7)).sample()
    probs[torch.randperm(vocab, generator=gen)[:zeros]] = 0.0
    probs = (probs / probs.sum()).float()
    n = 50_000
    shared = torch.Generator().manual_seed(seed + 1)
    tokens = sample(probs.expand(n, vocab), None, torch.zeros(n, dtype=torch.bool), shared_generator=shared)
    assert_matches(tokens, probs)


def test_sampler_distribution_shared_stream():
    torch.manual_seed(0)
    _test_distribution(vocab=16, seed=3, zeros=4)
    _test_distribution(vocab=7, seed=4, zeros=0)


def test_sampler_distribution_across_seeded_generators():
    probs = torch.tensor([0.05, 0.0, 0.45, 0.2, 0.0, 0.3])
    n = 4000
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)]
    tokens = sample(probs.expand(n, 6), gens, torch.zeros(n, dtype=torch.bool))
    assert_matches(tokens, probs)


def test_sampler_with_processed_probs_mixed_rows():
    # Rows processed with different settings, sampled together: each row's draws follow its own probs.
    logits = torch.log(torch.tensor([[1.0, 2, 3, 4]] * 3))
    probs = probs_from_logits(logits, torch.tensor([1.0, 0.5, 0.0]), torch.tensor([0, 3, 0]),
                              torch.tensor([0.75, 1.0, 1.0]))
    reps = 20_000
    batch = probs.repeat(reps, 1)
    greedy = torch.tensor([False, False, True]).repeat(reps)
    tokens = sample(batch, None, greedy, shared_generator=torch.Generator().manual_seed(8)).view(reps, 3)
    assert_matches(tokens[:, 0], probs[0])
    assert_matches(tokens[:, 1], probs[1])
    assert (tokens[:, 2] == 3).all()
