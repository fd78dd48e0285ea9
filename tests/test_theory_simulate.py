"""Monte Carlo agreement: the round simulator against Thm 2, Cor. 17 and the SD formula.

Each configuration's estimate comes with a standard error (ratio estimator over independent chains). We
require |sim - formula| < 4 SE everywhere and also check that the SEs are calibrated: the mean of z^2 over
the grid should be close to 1 (its standard deviation over n configurations is about sqrt(2/n)).
"""

import itertools

import numpy as np
import pytest

from saguaro.theory import (
    expected_tokens,
    sample_accepted,
    sd_speedup,
    simulate_sd,
    simulate_ssd,
    ssd_speedup_batch,
    unconditional_hit_rate,
)


def test_sample_accepted_matches_capped_geometric():
    rng = np.random.default_rng(0)
    for a, K in [(0.0, 3), (0.5, 2), (0.9, 6), (1.0, 4)]:
        x = sample_accepted(a, K, (200_000,), rng)
        assert x.min() >= 0 and x.max() <= K
        freq = np.bincount(x, minlength=K + 1) / x.size
        pmf = np.array([a**k * (1 - a) for k in range(K)] + [a**K])
        se = np.sqrt(pmf * (1 - pmf) / x.size)
        assert np.all(np.abs(freq - pmf) <= 5 * se + 1e-12)


def _grid():
    for a, K, p, T_p, T_b in itertools.product([0.5, 0.8, 0.95], [2, 4, 6], [0.3, 0.7, 0.9], [0.5, 1.5], [0.0, 0.4]):
        if T_b == 0.0:  # fast, weak backup: lower acceptance, and its speculations are harder to predict
            yield a, K, p, 0.5 * p, T_p, T_b, 0.3
        else:  # just-in-time primary as backup: same acceptance and hit rate
            yield a, K, p, p, T_p, T_b, a


def test_simulator_agrees_with_theorem2_and_corollary17():
    rng = np.random.default_rng(2024)
    z = []
    for (a, K, pp, pb, T_p, T_b, a_b), b in itertools.product(_grid(), [1, 4, 16]):
        sim = simulate_ssd(
            a, K, pp, pb, T_p, T_b, a_b=a_b, batch_size=b, n_rounds=60, n_chains=100, rng=rng
        )
        want = ssd_speedup_batch(
            unconditional_hit_rate(pp, pb), expected_tokens(a, K), expected_tokens(a_b, K), T_p, T_b, b
        )
        assert sim.stderr > 0
        assert sim.stderr < 0.05 * want  # the check has teeth
        zi = (sim.speedup - want) / sim.stderr
        assert abs(zi) < 4, (a, K, pp, pb, T_p, T_b, a_b, b, sim, want)
        z.append(zi)
    z = np.array(z)
    assert len(z) == 324
    assert 0.75 < np.mean(z**2) < 1.3
    assert abs(np.mean(z)) < 4 / np.sqrt(len(z))


def test_simulator_hit_rate_and_start_state():
    sim = simulate_ssd(0.8, 4, 0.9, 0.3, 0.5, 0.0, n_rounds=400, n_chains=200, rng=5, start="primary")
    assert sim.hit_rate == pytest.approx(unconditional_hit_rate(0.9, 0.3), abs=0.02)
    with pytest.raises(ValueError):
        simulate_ssd(0.8, 4, 0.9, 0.3, 0.5, 0.0, rng=5, start="nowhere")


@pytest.mark.parametrize("a,K,T", [(0.5, 2, 0.2), (0.8, 4, 0.4), (0.95, 6, 0.9)])
def test_sd_simulation_and_ssd_over_sd_ratio(a, K, T):
    rng = np.random.default_rng(7)
    sd = simulate_sd(a, K, T, n_rounds=200, n_chains=200, rng=rng)
    want = sd_speedup(expected_tokens(a, K), T)
    assert abs(sd.speedup - want) < 4 * sd.stderr
    # Cor. 3 in simulation: SSD with SD's own draft as primary and backup beats SD
    ssd = simulate_ssd(a, K, 0.7, 0.7, T, T, n_rounds=200, n_chains=200, rng=rng)
    assert ssd.speedup - sd.speedup > 4 * np.hypot(ssd.stderr, sd.stderr)
