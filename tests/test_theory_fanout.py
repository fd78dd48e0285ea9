"""Thm 12 (geometric fan-out), rounding to integers, Thm 13 solvers against brute force, power-law fit."""

import itertools

import numpy as np
import pytest

from saguaro.theory import (
    accepted_length_pmf,
    dp_fanout,
    fanout_objective,
    fit_power_law,
    geometric_fanout,
    greedy_fanout,
    integer_geometric_fanout,
    is_concave,
    optimal_fanout,
    power_law_hit,
    round_fanout,
)

GRID = list(itertools.product([0.3, 0.6, 0.8, 0.95], [0.3, 1.0, 2.5], [1, 3, 6], [8, 64, 1000]))


def test_power_law_hit_curve():
    assert power_law_hit(0, 0.7) == 0.0
    assert power_law_hit(1, 0.7) == 0.0
    assert power_law_hit(4, 0.5) == pytest.approx(0.5)
    np.testing.assert_allclose(power_law_hit(np.array([2.0, 8.0]), 1.0), [0.5, 0.875])


@pytest.mark.parametrize("a,r,K,B", GRID)
def test_geometric_fanout_closed_form(a, r, K, B):
    F = geometric_fanout(a, r, K, B)
    assert F.shape == (K + 1,)
    assert F.sum() == pytest.approx(B)
    # Thm 12 shape
    c = a ** (1 / (1 + r))
    np.testing.assert_allclose(F[1:K] / F[: K - 1], c)
    assert F[K] == pytest.approx(F[0] * a ** (K / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    # Thm 13 stationarity: P(k) * d/dF (1 - F^-r) is the same at every depth
    grad = accepted_length_pmf(a, K) * r * F ** (-r - 1)
    np.testing.assert_allclose(grad, grad[0], rtol=1e-9)


@pytest.mark.parametrize("a,r,K,B", GRID)
def test_geometric_beats_uniform_and_random_allocations(a, r, K, B):
    F = geometric_fanout(a, r, K, B)
    best = fanout_objective(F, a, r=r)
    uniform = fanout_objective(np.full(K + 1, B / (K + 1)), a, r=r)
    assert best > uniform
    rng = np.random.default_rng(K * 1000 + B)
    for _ in range(50):  # random feasible points with the same budget never do better
        G = rng.dirichlet(np.ones(K + 1)) * B
        G = np.maximum(G, 1e-9)
        G *= B / G.sum()
        assert fanout_objective(G, a, r=r) <= best + 1e-12


def test_geometric_fanout_with_caps():
    F = geometric_fanout(0.2, 1.0, 4, 40, max_fanout=12)
    assert F.sum() == pytest.approx(40)
    assert np.all(F <= 12 + 1e-12)
    free = F < 12 - 1e-9
    assert free.sum() >= 2
    w = accepted_length_pmf(0.2, 4) * F ** -2.0
    np.testing.assert_allclose(w[free], w[free][0])  # free depths keep the Thm 12 balance
    assert np.all(w[~free] >= w[free][0] - 1e-12)  # capped depths would like more
    with pytest.raises(ValueError):
        geometric_fanout(0.5, 1.0, 2, 100, max_fanout=10)


def test_round_fanout_sums_exactly_and_stays_close():
    rng = np.random.default_rng(1)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        B = int(rng.integers(0, 300))
        caps = rng.integers(1, 80, size=n)
        if caps.sum() < B:
            caps[0] += B - caps.sum()
        v = geometric_fanout(rng.uniform(0.05, 0.95), rng.uniform(0.2, 3), n - 1, B, caps) if n > 1 else np.array([B])
        F = round_fanout(v, B, caps)
        assert F.dtype.kind == "i"
        assert F.sum() == B
        assert np.all(F >= 0) and np.all(F <= caps)
        assert np.all(np.abs(F - v) < 1 + 1e-9)


def test_round_fanout_largest_remainder_example_and_rescaling():
    np.testing.assert_array_equal(round_fanout([1.2, 2.6, 3.2], 7), [1, 3, 3])
    np.testing.assert_array_equal(round_fanout([1, 1, 1], 10), [4, 3, 3])
    F = round_fanout([5.0, 1.0, 1.0], 9, max_fanout=[3, 10, 10])
    assert F.sum() == 9 and F[0] == 3
    F = integer_geometric_fanout(0.8, 0.5, 4, 64)
    assert F.sum() == 64 and np.all(np.abs(F - geometric_fanout(0.8, 0.5, 4, 64)) < 1)


def _random_concave_curve(rng, n):
    inc = np.sort(rng.uniform(0, 1, size=n - 1))[::-1]
    c = np.concatenate([[0.0], np.cumsum(inc)])
    return c / max(c[-1], 1e-12) * rng.uniform(0.3, 1.0)


def _brute_force(curves, B, w):
    best = -np.inf
    for F in itertools.product(*(range(len(c)) for c in curves)):
        if sum(F) <= B:
            best = max(best, sum(w[k] * curves[k][f] for k, f in enumerate(F)))
    return best


def test_greedy_matches_brute_force_on_concave_curves():
    rng = np.random.default_rng(13)
    for B in range(0, 9):
        for _ in range(15):
            curves = [_random_concave_curve(rng, int(rng.integers(2, 8))) for _ in range(3)]
            a = rng.uniform(0.1, 0.95)
            w = accepted_length_pmf(a, 2)
            assert all(is_concave(c) for c in curves)
            F = greedy_fanout(curves, B, a=a)
            assert F.sum() == min(B, sum(len(c) - 1 for c in curves))
            got = sum(w[k] * curves[k][F[k]] for k in range(3))
            assert got == pytest.approx(_brute_force(curves, B, w), abs=1e-12)
            np.testing.assert_array_equal(optimal_fanout(curves, B, a=a), F)


def test_dp_matches_brute_force_on_arbitrary_curves():
    rng = np.random.default_rng(17)
    for B in range(0, 9):
        for _ in range(10):
            curves = [np.concatenate([[0.0], np.sort(rng.uniform(0, 1, int(rng.integers(1, 7))))]) for _ in range(3)]
            w = rng.uniform(0, 1, 3)
            F = dp_fanout(curves, B, weights=w)
            assert F.sum() <= B
            got = sum(w[k] * curves[k][F[k]] for k in range(3))
            assert got == pytest.approx(_brute_force(curves, B, w), abs=1e-12)


@pytest.mark.parametrize("a,r,K", [(0.6, 0.5, 3), (0.8, 1.0, 5), (0.9, 0.3, 4)])
def test_discrete_optimum_has_geometric_shape(a, r, K):
    B = 200
    # shifted power law 1 - (1 + F)^-r is concave with p(0) = 0; its continuous optimum in G = 1 + F is
    # Thm 12 with budget B + K + 1.
    shifted = [1.0 - (1.0 + np.arange(B + 1)) ** (-r) for _ in range(K + 1)]
    F = greedy_fanout(shifted, B, a=a)
    cont = geometric_fanout(a, r, K, B + K + 1) - 1.0
    assert F.sum() == B
    assert np.max(np.abs(F - cont)) <= 1.5
    # the exact power law (not concave at the origin) through the DP: close to Thm 12 itself
    exact = [power_law_hit(np.arange(B + 1), r) for _ in range(K + 1)]
    assert not is_concave(exact[0])
    G = optimal_fanout(exact, B, a=a)
    assert G.sum() == B
    geo = geometric_fanout(a, r, K, B)
    assert np.max(np.abs(G - geo)) <= 1.5
    rounded = integer_geometric_fanout(a, r, K, B)
    assert fanout_objective(G, a, hit_curves=exact) >= fanout_objective(rounded, a, r=r) - 1e-12


def test_fit_power_law():
    F = np.array([1, 2, 4, 8, 16, 32])
    assert fit_power_law(F, F ** -0.63) == pytest.approx(0.63)
    rng = np.random.default_rng(0)
    noisy = F ** -0.4 * np.exp(rng.normal(0, 0.02, F.size))
    assert fit_power_law(F, noisy) == pytest.approx(0.4, abs=0.02)
    assert fit_power_law([2, 4, 0], [0.5, 0.25, 1.0]) == pytest.approx(1.0)  # F = 0 dropped
    with pytest.raises(ValueError):
        fit_power_law([1, 1], [1, 1])
