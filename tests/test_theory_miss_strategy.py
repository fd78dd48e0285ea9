"""Thm 18: the critical batch size b* against a brute-force comparison of the two Cor. 17 speedups."""

import math

import numpy as np
import pytest

from saguaro.theory import (
    choose_miss_strategy,
    critical_batch_size,
    expected_tokens,
    miss_strategy_speedups,
    ssd_speedup_batch,
)


def _paper_bstar(p, E_hit, E_miss, T_p):
    """Thm 18 exactly as printed in Appendix A (T_p < 1, T_ngram = 0, jit: T_b = T_p, E_miss = E_hit)."""
    inner = 1 + 1 / T_p - E_hit / (T_p * p * E_hit + T_p * (1 - p) * E_miss)
    return math.log(inner) / math.log(p)


def test_matches_paper_closed_form():
    for p, a, K, a_f, T_p in [(0.8, 0.8, 4, 0.2, 0.5), (0.95, 0.9, 6, 0.3, 0.3), (0.6, 0.7, 3, 0.0, 0.8)]:
        E_hit, E_miss = expected_tokens(a, K), expected_tokens(a_f, K)
        assert critical_batch_size(p, E_hit, T_p, E_miss) == pytest.approx(_paper_bstar(p, E_hit, E_miss, T_p))


def _draws(n, seed):
    rng = np.random.default_rng(seed)
    for i in range(n):
        K = int(rng.integers(2, 9))
        a_p = rng.uniform(0.5, 0.95)
        a_f = rng.uniform(0.0, 0.5)
        T_p = rng.uniform(0.05, 0.95) if i % 4 else rng.uniform(1.05, 2.0)  # some with T_p > 1
        T_ngram = 0.0 if i % 3 else rng.uniform(0.0, 0.2 * min(T_p, 1.0))  # clearly faster
        yield dict(
            p_hit=rng.uniform(0.3, 0.99),
            E_hit=expected_tokens(a_p, K),
            T_p=T_p,
            E_miss_ngram=expected_tokens(a_f, K),
            T_ngram=T_ngram,
        )


def test_bstar_matches_brute_force_over_batch_sizes():
    b = np.arange(1, 65)
    switches = 0
    for q in _draws(400, 18):
        bstar = critical_batch_size(**q)
        # brute force straight from Cor. 17: jit = primary re-drafts (E_miss = E_hit, T_b = T_p)
        s_jit = ssd_speedup_batch(q["p_hit"], q["E_hit"], q["E_hit"], q["T_p"], q["T_p"], b)
        s_ngram = ssd_speedup_batch(q["p_hit"], q["E_hit"], q["E_miss_ngram"], q["T_p"], q["T_ngram"], b)
        clear = np.abs(s_jit - s_ngram) > 1e-9 * s_ngram  # skip numerical ties: either answer is right
        want_jit = s_jit > s_ngram
        np.testing.assert_array_equal((b < bstar)[clear], want_jit[clear], err_msg=str((q, bstar)))
        for bi in {1, 2, 7, 33, 64, int(min(max(bstar, 1), 64))}:
            if clear[bi - 1]:
                assert choose_miss_strategy(bi, **q) == ("jit" if want_jit[bi - 1] else "ngram")
        assert miss_strategy_speedups(5, **q) == pytest.approx((s_jit[4], s_ngram[4]))
        switches += 1 < bstar < 64
    assert switches > 50  # the draws exercise real crossovers, not just one-sided cases


def test_jit_speedup_falls_with_batch_size_ngram_is_flat_when_tp_below_one():
    q = dict(p_hit=0.85, E_hit=expected_tokens(0.85, 5), T_p=0.6, E_miss_ngram=1.3)
    s = np.array([miss_strategy_speedups(b, **q) for b in range(1, 40)])
    assert np.all(np.diff(s[:, 0]) < 0)
    np.testing.assert_allclose(s[:, 1], s[0, 1])


def test_edge_cases():
    E = expected_tokens(0.8, 4)
    # never a miss: both options are the same, ties go to "ngram"
    s_jit, s_ngram = miss_strategy_speedups(8, 1.0, E, 0.5, 1.0)
    assert s_jit == pytest.approx(s_ngram)
    assert critical_batch_size(1.0, E, 0.5, 1.0) <= 1 and choose_miss_strategy(1, 1.0, E, 0.5, 1.0) == "ngram"
    assert critical_batch_size(0.8, E, 0.5, E) <= 0  # n-gram backup as good as the primary: always n-gram
    assert critical_batch_size(0.3, 5.0, 0.5, 1.0) == math.inf  # rare hits: jit wins at any b
    with pytest.raises(ValueError):
        critical_batch_size(0.8, E, 0.5, 1.0, T_ngram=0.5)  # "ngram" is not faster
    # a per-option hit rate: direct comparison still works
    assert choose_miss_strategy(64, 0.9, E, 0.5, 1.0, p_hit_ngram=0.5) in ("jit", "ngram")
