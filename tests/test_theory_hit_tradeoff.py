"""Def. 14 Saguaro sampling, Thm 15, and the Appendix A construction (analytically and by real sampling)."""

import numpy as np
import pytest

from saguaro.theory import (
    APPENDIX_CONSTRUCTION,
    acceptance_rate,
    expected_tokens,
    hit_probability_on_rejection,
    hit_probability_one_token,
    residual_distribution,
    saguaro_hit_rate_on_rejection,
    saguaro_probs,
    ssd_speedup,
    top_f_mask,
    unconditional_hit_rate,
)

P_T = np.array([0.48, 0.48, 0.02, 0.02])
P_D = np.array([0.49, 0.49, 0.01, 0.01])
C, F = 47 / 147, 2


def test_construction_analytic():
    q = saguaro_probs(P_D, F, C)
    np.testing.assert_allclose(q, [0.47, 0.47, 0.03, 0.03], atol=1e-12)
    np.testing.assert_allclose(q, APPENDIX_CONSTRUCTION["p_draft_saguaro"], atol=1e-12)
    assert acceptance_rate(P_T, P_D) == pytest.approx(0.98)
    assert acceptance_rate(P_T, q) == pytest.approx(0.98)
    np.testing.assert_allclose(residual_distribution(P_T, P_D), [0, 0, 0.5, 0.5], atol=1e-12)
    np.testing.assert_allclose(residual_distribution(P_T, q), [0.5, 0.5, 0, 0], atol=1e-12)
    # cache = top-F of the draft logits excluding the drafted (rejected) token
    assert hit_probability_on_rejection(P_T, P_D, F) == pytest.approx(0.5)
    assert hit_probability_on_rejection(P_T, q, F, rank_by=P_D) == pytest.approx(1.0)
    assert hit_probability_on_rejection(P_T, q, F) == pytest.approx(1.0)  # same set if ranked by q
    assert saguaro_hit_rate_on_rejection(P_T, P_D, F, C) == pytest.approx((0.98, 1.0))
    assert saguaro_hit_rate_on_rejection(P_T, P_D, F, 1.0) == pytest.approx((0.98, 0.5))


def _sampled_hit_rate(p_t, q, rank, F, n, rng):
    """Run verification for real: x ~ q, accept w.p. min(1, p_t/q), else bonus ~ residual; hit iff the bonus
    is among the top-F tokens of ``rank`` other than x. Returns (acceptance, hits, rejections)."""
    V = len(p_t)
    x = rng.choice(V, size=n, p=q)
    accept = rng.random(n) < np.minimum(1.0, p_t[x] / q[x])
    rej_x = x[~accept]
    resid = np.maximum(p_t - q, 0.0)
    bonus = rng.choice(V, size=rej_x.size, p=resid / resid.sum())
    order = np.argsort(-rank, kind="stable")
    cache = np.zeros((V, V), dtype=bool)  # cache[x] = top-F excluding x
    for t in range(V):
        cache[t, [y for y in order if y != t][:F]] = True
    hits = cache[rej_x, bonus]
    return accept.mean(), int(hits.sum()), int(rej_x.size)


def test_construction_by_sampling():
    rng = np.random.default_rng(147)
    n = 1_000_000
    q = saguaro_probs(P_D, F, C)
    for draft, want_hit in [(P_D, 0.5), (q, 1.0)]:
        acc, hits, rej = _sampled_hit_rate(P_T, draft, P_D, F, n, rng)
        se_acc = np.sqrt(0.98 * 0.02 / n)  # binomial standard error of the acceptance frequency
        assert abs(acc - 0.98) < 5 * se_acc
        assert rej > 15_000
        rate = hits / rej
        se_hit = np.sqrt(want_hit * (1 - want_hit) / rej)  # binomial SE of the hit frequency (0 when p = 1)
        assert abs(rate - want_hit) <= 5 * se_hit
    # ... and with equal acceptance, the higher p_hit,p makes SSD faster (Thm 2); backup quantities unchanged
    E = expected_tokens(0.98, 4)
    plain = ssd_speedup(unconditional_hit_rate(0.5, 0.4), E, 1.5, 0.8, 0.0)
    saguaro = ssd_speedup(unconditional_hit_rate(1.0, 0.4), E, 1.5, 0.8, 0.0)
    assert saguaro > plain


def test_saguaro_probs_properties():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(10))
    np.testing.assert_allclose(saguaro_probs(p, 3, 1.0), p)
    s = saguaro_probs(p, 3, 0.25)
    assert s.sum() == pytest.approx(1.0)
    top = top_f_mask(p, 3)
    assert top.sum() == 3 and set(np.nonzero(top)[0]) == set(np.argsort(-p)[:3])
    np.testing.assert_allclose(s[top] / s[~top].sum(), 0.25 * p[top] / p[~top].sum())
    batch = rng.dirichlet(np.ones(6), size=5)
    sb = saguaro_probs(batch, 2, 0.5)
    np.testing.assert_allclose(sb[3], saguaro_probs(batch[3], 2, 0.5))
    assert saguaro_probs(p, 0, 0.1) == pytest.approx(p)
    with pytest.raises(ValueError):
        saguaro_probs(p, 2, 1.5)


def test_theorem15_hit_rate_rises_as_c_falls():
    rng = np.random.default_rng(15)
    Cs = np.linspace(0.0, 1.0, 11)
    for _ in range(100):
        V = int(rng.integers(3, 12))
        p_d = rng.dirichlet(np.full(V, 0.5))
        p_t = rng.dirichlet(np.full(V, 0.5))
        Fc = int(rng.integers(1, V))
        hits = [saguaro_hit_rate_on_rejection(p_t, p_d, Fc, c, exclude_drafted=False)[1] for c in Cs]
        assert np.all(np.diff(hits) <= 1e-12)


def test_one_token_hit_probability_by_sampling():
    rng = np.random.default_rng(1)
    V, F0, F1 = 5, 2, 2
    p_t, q = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    nxt = rng.dirichlet(np.ones(V), size=V)
    rank_next = rng.dirichlet(np.ones(V), size=V)
    want = hit_probability_one_token(p_t, q, F0, nxt, rank_next, F1)
    n = 400_000
    x = rng.choice(V, size=n, p=q)
    accept = rng.random(n) < np.minimum(1.0, p_t[x] / q[x])
    resid = residual_distribution(p_t, q)
    hit = np.zeros(n, dtype=bool)
    order = np.argsort(-q, kind="stable")
    rej = np.nonzero(~accept)[0]
    bonus = rng.choice(V, size=rej.size, p=resid)
    cache0 = np.array([[y for y in order if y != t][:F0] for t in range(V)])
    hit[rej] = (cache0[x[rej]] == bonus[:, None]).any(axis=1)
    acc = np.nonzero(accept)[0]
    cum = np.cumsum(nxt[x[acc]], axis=1)  # inverse-cdf sampling from the row of x
    bonus1 = np.minimum((rng.random(acc.size)[:, None] > cum).sum(axis=1), V - 1)
    hit[acc] = top_f_mask(rank_next, F1)[x[acc], bonus1]
    se = np.sqrt(want * (1 - want) / n)
    assert abs(hit.mean() - want) < 5 * se


def test_theorem15_monotonicity_is_for_the_fixed_cache_only():
    """Thm 15 fixes S = top_F(z). With the engine's cache (top-F excluding the drafted token), lowering C can
    lower the hit rate on rejection: here C = 1 -> 0.374, C = 0.5 -> 0.154 (worked by hand in the report)."""
    p_d = np.array([0.18, 0.39, 0.36, 0.07])
    p_t = np.array([0.08, 0.15, 0.54, 0.23])
    _, h_half = saguaro_hit_rate_on_rejection(p_t, p_d, 1, 0.5)
    _, h_one = saguaro_hit_rate_on_rejection(p_t, p_d, 1, 1.0)
    assert h_one == pytest.approx(0.24 * (0.18 / 0.34) / 0.34)
    assert h_half < h_one - 0.2
    fixed = [saguaro_hit_rate_on_rejection(p_t, p_d, 1, c, exclude_drafted=False)[1] for c in (0.5, 1.0)]
    assert fixed[0] >= fixed[1]
