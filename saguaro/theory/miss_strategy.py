"""Which speculator handles a cache miss: Thm 18 and the critical batch size b* (paper Sec. 4.3, Appendix A).

Two miss strategies are compared through Cor. 17 (see :mod:`saguaro.theory.speedup` for the symbols):

* **jit** -- the primary draft speculates just in time. It is slow but accurate: by default its miss rounds
  take ``T_jit = T_p`` and yield ``E_miss_jit = E_hit`` tokens.
* **ngram** -- the n-gram backup (or any cheap speculator, e.g. random tokens): ``T_ngram`` close to 0, a
  low ``E_miss_ngram``.

With one per-sequence hit probability p_hit for both choices (the paper's assumption), write x = p_hit^b for
the probability that the whole batch hits, m = max(1, T_p) for the latency of an all-hit round, and for each
option o in {jit, ngram}

    N_o = p_hit E_hit + (1 - p_hit) E_miss_o      (tokens per sequence per round),
    D_o(x) = x m + (1 - x)(1 + T_o) = A_o - x c_o,  A_o = 1 + T_o,  c_o = 1 + T_o - m.

jit is better iff N_jit D_ngram(x) > N_ngram D_jit(x), i.e. iff  x alpha > beta  with

    alpha = N_ngram c_jit - N_jit c_ngram,     beta = N_ngram A_jit - N_jit A_ngram.

This is linear in x. When alpha > 0 (jit's stall grows with b faster than ngram's), jit wins iff
p_hit^b > x* = beta / alpha, i.e. iff b < b* = log(x*) / log(p_hit). In the paper's setting (T_p < 1, so
m = 1; T_ngram = 0; T_jit = T_p; E_miss_jit = E_hit) this is Thm 18:

    b* = log(1 + 1/T_p - E_hit / (T_p [p_hit E_hit + (1 - p_hit) E_miss])) / log(p_hit).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from .speedup import ssd_speedup_batch

__all__ = ["critical_batch_size", "miss_strategy_speedups", "choose_miss_strategy"]


def _options(p_hit, E_hit, T_p, E_miss_jit, T_jit):
    if not 0.0 <= p_hit <= 1.0:
        raise ValueError(f"p_hit must lie in [0, 1], got {p_hit}")
    E_miss_jit = E_hit if E_miss_jit is None else E_miss_jit
    T_jit = T_p if T_jit is None else T_jit
    return E_miss_jit, T_jit


def critical_batch_size(
    p_hit: float,
    E_hit: float,
    T_p: float,
    E_miss_ngram: float,
    T_ngram: float = 0.0,
    E_miss_jit: float | None = None,
    T_jit: float | None = None,
) -> float:
    """Thm 18: the batch size b* below which the just-in-time (primary) miss strategy beats the n-gram one.

    Decision rule: use "jit" for b < b*, "ngram" for b >= b*. Arguments: ``p_hit`` -- per-sequence
    unconditional hit rate (shared by both options); ``E_hit`` -- tokens per round after a hit; ``T_p`` --
    primary drafting time; ``E_miss_ngram``, ``T_ngram`` -- tokens and drafting time of the n-gram backup;
    ``E_miss_jit``, ``T_jit`` -- same for the jit backup (default ``E_hit`` and ``T_p``).

    Returns ``math.inf`` when jit wins at every batch size and a value <= 1 (possibly negative) when ngram wins
    already at b = 1. Raises ``ValueError`` when alpha <= 0 (see module docstring), i.e. the "slow" option is not
    the one whose all-batch stall grows with b, so no threshold of the form "jit below b*" exists.
    """
    E_miss_jit, T_jit = _options(p_hit, E_hit, T_p, E_miss_jit, T_jit)
    m = max(1.0, T_p)
    n_jit = p_hit * E_hit + (1.0 - p_hit) * E_miss_jit
    n_ngram = p_hit * E_hit + (1.0 - p_hit) * E_miss_ngram
    c_jit, c_ngram = 1.0 + T_jit - m, 1.0 + T_ngram - m
    alpha = n_ngram * c_jit - n_jit * c_ngram
    beta = n_ngram * (1.0 + T_jit) - n_jit * (1.0 + T_ngram)
    if alpha <= 0.0:
        raise ValueError(
            "no critical batch size: the jit strategy's relative cost does not grow with batch size "
            f"(alpha = {alpha:g} <= 0); compare the options with choose_miss_strategy instead"
        )
    x_star = beta / alpha
    if p_hit >= 1.0:  # x = 1 at every b
        return math.inf if 1.0 > x_star else 0.0
    if x_star <= 0.0:  # p_hit^b > 0 >= x* for every b (p_hit > 0); with p_hit = 0, x = 0 > x* iff x* < 0
        return math.inf if (p_hit > 0.0 or x_star < 0.0) else 0.0
    if p_hit <= 0.0:  # x = 0 < x* at every b >= 1
        return 0.0
    return math.log(x_star) / math.log(p_hit)


def miss_strategy_speedups(
    batch_size: float,
    p_hit: float,
    E_hit: float,
    T_p: float,
    E_miss_ngram: float,
    T_ngram: float = 0.0,
    E_miss_jit: float | None = None,
    T_jit: float | None = None,
    p_hit_ngram: float | None = None,
) -> tuple[float, float]:
    """Cor. 17 speedups ``(speedup_jit, speedup_ngram)`` at ``batch_size`` for the two miss strategies.

    ``p_hit_ngram`` (default ``p_hit``) lets the n-gram option have its own unconditional hit rate, e.g. when the
    primary predicts outcomes of the n-gram backup's speculations less well (p_hit,b changes, see
    ``unconditional_hit_rate``). The closed form b* assumes they are equal.
    """
    E_miss_jit, T_jit = _options(p_hit, E_hit, T_p, E_miss_jit, T_jit)
    p_ngram = p_hit if p_hit_ngram is None else p_hit_ngram
    s_jit = ssd_speedup_batch(p_hit, E_hit, E_miss_jit, T_p, T_jit, batch_size)
    s_ngram = ssd_speedup_batch(p_ngram, E_hit, E_miss_ngram, T_p, T_ngram, batch_size)
    return float(s_jit), float(s_ngram)


def choose_miss_strategy(*args: Any, **kwargs: Any) -> str:
    """Thm 18 decision: ``"jit"`` if the just-in-time primary strategy has the larger Cor. 17 speedup at this
    batch size, else ``"ngram"`` (ties go to "ngram"). The arguments are ``miss_strategy_speedups``' (its
    signature is this one's too, for ``help`` and ``inspect``).

    With ``p_hit_ngram`` unset this equals ``"jit" if batch_size < critical_batch_size(...) else "ngram"``; the
    direct comparison also covers a per-option hit rate, where no closed form exists.
    """
    s_jit, s_ngram = miss_strategy_speedups(*args, **kwargs)
    return "jit" if s_jit > s_ngram else "ngram"


choose_miss_strategy.__signature__ = inspect.signature(miss_strategy_speedups).replace(  # type: ignore[attr-defined]
    return_annotation=str)
