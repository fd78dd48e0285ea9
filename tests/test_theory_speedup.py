"""Closed forms of saguaro.theory.speedup: E(a, K), Thm 2, Cors. 3, 4 and 17, stationary hit rate."""

import math

import numpy as np
import pytest

from saguaro.theory import (
    accepted_length_pmf,
    expected_tokens,
    hit_rate_after_rounds,
    sd_speedup,
    simulate_hit_chain,
    ssd_over_sd_bounds,
    ssd_same_speculator_speedup,
    ssd_speedup,
    ssd_speedup_batch,
    ssd_speedup_batch_limit,
    unconditional_hit_rate,
)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.99, 1.0])
@pytest.mark.parametrize("K", [0, 1, 4, 7])
def test_expected_tokens_is_mean_of_capped_geometric(a, K):
    pmf = accepted_length_pmf(a, K)
    assert pmf.sum() == pytest.approx(1.0)
    assert np.all(pmf >= 0)
    assert expected_tokens(a, K) == pytest.approx(float(np.sum(pmf * (np.arange(K + 1) + 1))))
    assert expected_tokens(a, K) == pytest.approx(sum(a**k for k in range(K + 1)))


def test_expected_tokens_broadcasts():
    E = expected_tokens(np.array([0.5, 1.0]), np.array([[2], [3]]))
    np.testing.assert_allclose(E, [[1.75, 3.0], [1.875, 4.0]])


def test_theorem2_reduces_to_parts():
    # all hits with T_p <= 1: E_hit per unit time; all misses: E_miss / (1 + T_b)
    assert ssd_speedup(1.0, 3.0, 1.2, 0.7, 0.4) == pytest.approx(3.0)
    assert ssd_speedup(1.0, 3.0, 1.2, 1.5, 0.4) == pytest.approx(2.0)
    assert ssd_speedup(0.0, 3.0, 1.2, 0.7, 0.4) == pytest.approx(1.2 / 1.4)
    p = 0.6
    want = (p * 3.0 + (1 - p) * 1.2) / (p * 1.0 + (1 - p) * 1.4)
    assert ssd_speedup(p, 3.0, 1.2, 0.7, 0.4) == pytest.approx(want)
    assert sd_speedup(3.0, 0.5) == pytest.approx(2.0)


def test_corollary17_batch_one_is_theorem2_and_limit():
    args = (0.8, 3.4, 1.1, 0.6, 0.3)
    assert ssd_speedup_batch(*args, 1) == pytest.approx(ssd_speedup(*args))
    # a measured wait for the speculator's answer adds to every round's latency
    base = ssd_speedup_batch(*args, 4)
    waited = ssd_speedup_batch(*args, 4, 0.25)
    assert 1.0 / waited == pytest.approx(1.0 / base + 0.25 / (args[0] * args[1] + (1 - args[0]) * args[2]))
    big = ssd_speedup_batch(*args, 10_000)
    assert big == pytest.approx(ssd_speedup_batch_limit(0.8, 3.4, 1.1, 0.3))
    assert ssd_speedup_batch(*args, np.inf) == pytest.approx(big)
    # speedup falls with batch size when a miss round is slower than a hit round
    s = ssd_speedup_batch(*args, np.arange(1, 65))
    assert np.all(np.diff(s) < 0)


def test_corollary3_ssd_with_sd_draft_never_slower_than_sd():
    rng = np.random.default_rng(3)
    for _ in range(2000):
        p = rng.uniform(0, 1)
        a, K = rng.uniform(0, 1), int(rng.integers(1, 9))
        T = rng.uniform(0, 3)
        E = expected_tokens(a, K)
        ssd, sd = ssd_same_speculator_speedup(p, E, T), sd_speedup(E, T)
        assert ssd >= sd * (1 - 1e-12)
        if p > 1e-6 and T > 1e-6:
            assert ssd > sd
    assert ssd_same_speculator_speedup(0.0, 3.0, 0.5) == pytest.approx(sd_speedup(3.0, 0.5))
    assert ssd_same_speculator_speedup(0.9, 3.0, 0.0) == pytest.approx(sd_speedup(3.0, 0.0))


def test_corollary4_sandwich_on_random_draws():
    rng = np.random.default_rng(4)
    for _ in range(2000):
        K = int(rng.integers(1, 9))
        a_hit, a_sd = rng.uniform(0, 1), rng.uniform(0, 1)
        a_miss = rng.uniform(0, a_hit)  # E_miss <= E_hit
        E_hit, E_miss, E_sd = (expected_tokens(x, K) for x in (a_hit, a_miss, a_sd))
        p, T_p, T_sd = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 2)
        ratio = ssd_speedup(p, E_hit, E_miss, T_p, 0.0) / sd_speedup(E_sd, T_sd)
        lo, hi = ssd_over_sd_bounds(p, E_hit, E_sd, T_sd)
        assert lo * (1 - 1e-12) <= ratio <= hi * (1 + 1e-12)


def test_unconditional_hit_rate_is_stationary_point():
    for pp, pb in [(0.9, 0.3), (0.5, 0.5), (0.2, 0.8), (1.0, 0.4), (0.7, 0.0)]:
        p = unconditional_hit_rate(pp, pb)
        assert p == pytest.approx(p * pp + (1 - p) * pb)
    assert unconditional_hit_rate(0.6, 0.6) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        unconditional_hit_rate(1.0, 0.0)


def test_hit_rate_recurrence_closed_form():
    pp, pb = 0.85, 0.35
    p = pp
    for T in range(1, 30):
        p = p * pp + (1 - p) * pb
        assert hit_rate_after_rounds(pp, pb, T) == pytest.approx(p)
    assert hit_rate_after_rounds(pp, pb, 500) == pytest.approx(unconditional_hit_rate(pp, pb))


@pytest.mark.parametrize("pp,pb", [(0.9, 0.3), (0.6, 0.6), (0.2, 0.7), (0.95, 0.05)])
def test_unconditional_hit_rate_matches_simulated_chain(pp, pb):
    rate, se = simulate_hit_chain(pp, pb, n_rounds=2000, n_chains=200, rng=11)
    assert se > 0
    assert abs(rate - unconditional_hit_rate(pp, pb)) < 4 * se


def test_invalid_inputs():
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)
    with pytest.raises(ValueError):
        accepted_length_pmf(0.5, -1)
    with pytest.raises(ValueError):
        ssd_speedup_batch(0.5, 2, 1, 0.5, 0.0, 0)
    assert math.isfinite(ssd_speedup(0.5, 2, 1, 0.5, 0.0))
