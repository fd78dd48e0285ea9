"""Monte Carlo simulation of SD and SSD rounds, to check Thm 2 and Cor. 17 (symbols as in ``speedup``).

SSD model (Appendix A). Every sequence carries a state s in {primary, backup}: which speculator produced the
speculation verified in this round. A round

* yields 1 + A tokens, A ~ capped geometric: P(A = k) = a^k (1 - a) for k < K, P(A = K) = a^K, with
  (a, K) = (a_p, K_p) in the primary state and (a_b, K_b) in the backup state;
* lasts max(1, T_p) if every sequence of the batch is in the primary state (all hit), else 1 + T_b;
* moves a sequence to the primary state (a cache hit for the next round) with probability p_hit,p from the
  primary state and p_hit,b from the backup state, independently across sequences.

Chains start in the stationary law (primary with probability p_hit from ``unconditional_hit_rate``) unless
``start="primary"``. The reported speedup is total tokens per sequence / total time (AR makes 1 token per unit
time). Its standard error is the delta-method error of a ratio estimator over ``n_chains`` independent chains
(each chain: one batch, ``n_rounds`` rounds): se = sqrt(sum_c (X_c - R Y_c)^2 / (n (n-1))) / mean(Y).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .speedup import unconditional_hit_rate

__all__ = ["SimResult", "sample_accepted", "simulate_hit_chain", "simulate_ssd", "simulate_sd"]


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of a simulation: speedup over AR, its standard error, the fraction of sequence-rounds that were
    cache hits (nan for SD), mean tokens per sequence per round and mean round latency."""

    speedup: float
    stderr: float
    hit_rate: float
    tokens_per_round: float
    latency_per_round: float


def _rng(rng) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def sample_accepted(a, K, size, rng) -> np.ndarray:
    """Draw accepted-draft counts from the capped geometric law (``a``, ``K`` broadcast against ``size``).

    Uses A = min(floor(log U / log a), K) with U ~ Uniform(0, 1], since P(floor(log U / log a) >= k) = a^k.
    """
    rng = _rng(rng)
    a = np.broadcast_to(np.asarray(a, dtype=float), size)
    K = np.broadcast_to(np.asarray(K), size)
    u = 1.0 - rng.random(size)  # in (0, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.floor(np.log(u) / np.log(np.where((a > 0) & (a < 1), a, 0.5)))
    g = np.where(a >= 1.0, K, np.where(a <= 0.0, 0, g))
    return np.minimum(g, K).astype(np.int64)


def _ratio(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    n = x.size
    ratio = x.sum() / y.sum()
    if n < 2:
        return float(ratio), float("nan")
    resid = x - ratio * y
    se = np.sqrt(np.sum(resid**2) / (n * (n - 1))) / y.mean()
    return float(ratio), float(se)


def _states(p_hit_p, p_hit_b, n_rounds, shape, rng, start) -> np.ndarray:
    """Boolean array (n_rounds, *shape): True where the round's speculation came from the primary (a hit)."""
    if start == "stationary":
        s = rng.random(shape) < unconditional_hit_rate(p_hit_p, p_hit_b)
    elif start == "primary":
        s = np.ones(shape, dtype=bool)
    else:
        raise ValueError("start must be 'stationary' or 'primary'")
    u = rng.random((n_rounds, *shape))
    out = np.empty((n_rounds, *shape), dtype=bool)
    for t in range(n_rounds):
        out[t] = s
        s = u[t] < np.where(s, p_hit_p, p_hit_b)
    return out


def simulate_hit_chain(p_hit_p, p_hit_b, n_rounds: int, n_chains: int, rng=None, start="primary"):
    """Long-run fraction of hits of the two-state chain, with its standard error over independent chains.

    Returns ``(hit_rate, stderr)``; compare with ``unconditional_hit_rate`` (Thm 2, Part 2).
    """
    rng = _rng(rng)
    hits = _states(p_hit_p, p_hit_b, n_rounds + 1, (n_chains,), rng, start)[1:]  # round 0 is the start state
    per_chain = hits.mean(axis=0)
    return float(per_chain.mean()), float(per_chain.std(ddof=1) / np.sqrt(n_chains))


def simulate_ssd(
    a_p: float,
    K: int,
    p_hit_p: float,
    p_hit_b: float,
    T_p: float,
    T_b: float,
    *,
    a_b: float | None = None,
    K_b: int | None = None,
    batch_size: int = 1,
    n_rounds: int = 200,
    n_chains: int = 200,
    rng=None,
    start: str = "stationary",
) -> SimResult:
    """Simulate SSD (Alg. 1 abstracted to hits, accepted lengths and latencies); see the module docstring.

    ``a_b``, ``K_b`` -- acceptance and lookahead of backup-speculated rounds (default: the primary's).
    Expected value: ``ssd_speedup_batch(unconditional_hit_rate(p_hit_p, p_hit_b), expected_tokens(a_p, K),
    expected_tokens(a_b, K_b), T_p, T_b, batch_size)``.
    """
    rng = _rng(rng)
    a_b = a_p if a_b is None else a_b
    K_b = K if K_b is None else K_b
    shape = (n_rounds, n_chains, batch_size)
    state = _states(p_hit_p, p_hit_b, n_rounds, shape[1:], rng, start)
    accepted = sample_accepted(np.where(state, a_p, a_b), np.where(state, K, K_b), shape, rng)
    tokens = (accepted + 1).mean(axis=2)  # per sequence, (n_rounds, n_chains)
    all_hit = state.all(axis=2)
    latency = np.where(all_hit, max(1.0, T_p), 1.0 + T_b)
    speedup, se = _ratio(tokens.sum(axis=0), latency.sum(axis=0))
    return SimResult(speedup, se, float(state.mean()), float(tokens.mean()), float(latency.mean()))


def simulate_sd(a: float, K: int, T_sd: float, *, n_rounds: int = 200, n_chains: int = 200, rng=None) -> SimResult:
    """Simulate ordinary SD: each round drafts K tokens (time T_SD), verifies (time 1), yields 1 + A tokens.

    Expected value: ``sd_speedup(expected_tokens(a, K), T_sd)``.
    """
    rng = _rng(rng)
    tokens = sample_accepted(a, K, (n_rounds, n_chains), rng) + 1
    latency = np.full((n_rounds, n_chains), 1.0 + T_sd)
    speedup, se = _ratio(tokens.sum(axis=0).astype(float), latency.sum(axis=0))
    return SimResult(speedup, se, float("nan"), float(tokens.mean()), float(latency.mean()))
