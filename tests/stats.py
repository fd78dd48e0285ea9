"""Helpers for distribution tests: total-variation distance and a principled pass/fail threshold.

Setting. ``X_1 .. X_n`` are i.i.d. draws from a distribution ``p`` over ``m`` outcomes, ``p_hat`` is
their histogram divided by ``n``, and ``TV = (1/2) * sum_i |p_hat_i - p_i|``. A test asserts
``TV <= tv_threshold(n, m, delta)``; if the code under test samples from ``p`` exactly, the assertion
fails with probability at most ``delta``.

Derivation of the threshold ``E_bound + t``.

1. Mean. ``n * p_hat_i ~ Binomial(n, p_i)``, so ``Var(p_hat_i) = p_i (1 - p_i) / n``. By Jensen
   (or Cauchy-Schwarz for one variable), ``E|p_hat_i - p_i| <= sqrt(Var(p_hat_i))``. Summing and
   applying Cauchy-Schwarz over the ``m`` outcomes,

       sum_i sqrt(p_i (1 - p_i))  <=  sqrt(m * sum_i p_i (1 - p_i))  =  sqrt(m * (1 - sum_i p_i^2))
                                  <=  sqrt(m * (1 - 1/m))  =  sqrt(m - 1),

   using ``sum_i p_i^2 >= 1/m`` (Cauchy-Schwarz again). Hence ``E[TV] <= 0.5 * sqrt((m - 1) / n)``.
   Outcomes with ``p_i = 0`` have ``p_hat_i = 0`` under the null hypothesis, so ``m`` may be taken as
   the size of the support of ``p``; passing the full outcome count is also valid, only looser.

2. Concentration. TV is a function of the ``n`` independent draws. Replacing one draw moves ``1/n``
   of empirical mass from one outcome to another: two terms ``|p_hat_i - p_i|`` each change by at
   most ``1/n``, so the sum changes by at most ``2/n`` and TV by at most ``c = 1/n``. McDiarmid's
   bounded-differences inequality gives

       P(TV - E[TV] >= t)  <=  exp(-2 t^2 / (n * c^2))  =  exp(-2 n t^2).

   Setting the right side to ``delta``: ``t = sqrt(ln(1/delta) / (2 n))``.

So ``P(TV >= 0.5 * sqrt((m - 1) / n) + sqrt(ln(1/delta) / (2 n))) <= delta``. For ``n = 50,000``,
``m = 64`` and ``delta = 1e-6``: ``0.0177 + 0.0118 = 0.0296``.
"""
from __future__ import annotations

import math

import torch


def empirical(samples: torch.Tensor, m: int) -> torch.Tensor:
    """Histogram of integer outcomes in ``[0, m)``, divided by the number of samples (float64)."""
    samples = samples.reshape(-1).to(torch.int64)
    if samples.numel() == 0:
        raise ValueError("no samples")
    if int(samples.min()) < 0 or int(samples.max()) >= m:
        raise ValueError(f"samples outside [0, {m})")
    return torch.bincount(samples, minlength=m).to(torch.float64) / samples.numel()


def tv_distance(p_hat: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance ``0.5 * sum |p_hat - p|`` between two distributions on the same outcomes."""
    p_hat = p_hat.reshape(-1).to(torch.float64)
    p = p.reshape(-1).to(torch.float64)
    if p_hat.shape != p.shape:
        raise ValueError(f"shape mismatch {tuple(p_hat.shape)} vs {tuple(p.shape)}")
    return 0.5 * float((p_hat - p).abs().sum())


def tv_threshold(n: int, m: int, delta: float = 1e-6) -> float:
    """Threshold ``0.5 * sqrt((m - 1) / n) + sqrt(ln(1 / delta) / (2 n))`` (see the module docstring).

    Args:
        n: number of i.i.d. samples.
        m: number of outcomes with positive probability (an upper bound on it is also valid).
        delta: allowed probability of failing when the sampler is exact.
    """
    if n <= 0 or m <= 0 or not 0 < delta < 1:
        raise ValueError(f"bad arguments n={n}, m={m}, delta={delta}")
    return 0.5 * math.sqrt((m - 1) / n) + math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def assert_matches(samples: torch.Tensor, p: torch.Tensor, delta: float = 1e-6) -> float:
    """Assert the samples' histogram is within the TV threshold of ``p``; also no draw off ``p``'s support.

    Returns the measured TV distance.
    """
    p = p.reshape(-1).to(torch.float64)
    p_hat = empirical(samples, p.numel())
    off_support = float(p_hat[p == 0].sum())
    assert off_support == 0.0, f"{off_support:.3g} of the samples fell on zero-probability outcomes"
    tv = tv_distance(p_hat, p)
    threshold = tv_threshold(samples.numel(), int((p > 0).sum()), delta)
    assert tv <= threshold, f"TV {tv:.4f} exceeds threshold {threshold:.4f} (n={samples.numel()})"
    return tv
