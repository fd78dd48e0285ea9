"""How many prompt tokens one prefill step feeds: a fixed number, or "auto", sized by time.

Glossary:
  step budget   the time one prefill step may take: what a running stream waits for, beyond its own
                round, while a long prompt arrives (prefill and decode steps alternate). Defaults:
                ``DEFAULT_BUDGET_S`` (0.25 s on a CPU, 25 ms on a GPU); ``prefill_step_budget_s`` sets it.
  cost model    the time of a pass that feeds sequences n_i new tokens after c_i cached ones:
                    t = fixed + per_token * sum(n_i) + per_pair * sum(n_i * (c_i + (n_i - 1) / 2))
                the pass's own cost (weights read once), the GEMMs' cost per token, and attention's per
                (query, key) pair: why a chunk late in a long prompt costs more than an early one. The
                engine times every prefill step (a draft's chunk included) and refits the three costs
                (least squares over the latest ``WINDOW`` steps, none negative), so the chunk follows the
                model, the device, the backend and the context already cached.
  auto chunk    in admission order, each prefilling sequence gets the most tokens whose predicted time
                fits what is left of the budget. Bounds: the first gets at least one token (a step makes
                progress), and at least as many as cost what the pass's fixed cost does (below that a
                pass is mostly its fixed cost, and the prompt would crawl); a step feeds at most twice the
                most one step of the window fed (the fit is not trusted far outside the steps it was fitted
                to); none gets more than its prompt has left. Before any step is timed, a step feeds
                ``PROBE_TOKENS``.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

DEFAULT_BUDGET_S = {"cpu": 0.25, "cuda": 0.025}
PROBE_TOKENS = 32
WINDOW = 32  # timed steps the costs are fitted to

Row = tuple[int, int]  # (tokens fed this step, tokens already cached) for one sequence


@dataclass(frozen=True)
class PrefillCost:
    """Seconds a prefill pass costs: ``fixed`` per pass, ``per_token`` per fed token, ``per_pair`` per (fed
    token, key it attends to)."""
    fixed: float
    per_token: float
    per_pair: float

    def seconds(self, n: int, cached: int) -> float:
        """One sequence's share of a pass (``fixed`` not included)."""
        return n * self.per_token + self.per_pair * _pairs(n, cached)

    def most_tokens(self, budget_s: float, cached: int) -> int:
        """The most tokens whose share fits ``budget_s`` after ``cached`` (0 if not one: also when the pass's fixed
        cost alone has spent the budget, ``budget_s`` <= 0, as on a loaded machine)."""
        if budget_s <= 0:
            return 0
        a, b = self.per_pair / 2, self.per_token + self.per_pair * (cached - 0.5)
        if a <= 0:
            return max(0, int(budget_s // b)) if b > 0 else 1 << 30
        return max(0, int((-b + math.sqrt(b * b + 4 * a * budget_s)) / (2 * a)))  # the root of a n^2 + b n = budget


def _pairs(n: int, cached: int) -> float:
    """(query, key) pairs of ``n`` causal queries after ``cached`` keys."""
    return n * (cached + (n - 1) / 2)


def _features(rows: list[Row]) -> list[float]:
    return [1.0, float(sum(n for n, _ in rows)), sum(_pairs(n, c) for n, c in rows)]


class PrefillCosts:
    """The cost model, refitted to the latest timed steps."""

    def __init__(self, window: int = WINDOW):
        self.steps: deque[tuple[list[float], float]] = deque(maxlen=window)
        self.cost: PrefillCost | None = None  # None until a step is timed

    @property
    def largest(self) -> int:
        """The most tokens one step of the window fed: the fit is trusted up to twice that. Of the window, not of
        all time: late in a long prompt the window's steps are small and alike, and a fit that cannot tell the
        pass's fixed cost from attention's once fed 348 tokens at 6,900 cached (2.8 s against 0.35 predicted)
        because a chunk twice that size had been timed early in the prompt."""
        return int(max((f[1] for f, _ in self.steps), default=0))

    def observe(self, rows: list[Row], seconds: float) -> None:
        self.steps.append((_features(rows), seconds))
        self.cost = _fit(self.steps)


def _fit(steps) -> PrefillCost:
    """Non-negative least squares on three costs: the best fit over every subset of them (the per-token cost
    always in it, so that no chunk is free), keeping only fits with no negative cost."""
    x = np.array([f for f, _ in steps])
    t = np.array([s for _, s in steps])
    best, best_error = np.array([0.0, t.sum() / max(x[:, 1].sum(), 1.0), 0.0]), math.inf
    for extra in itertools.chain.from_iterable(itertools.combinations((0, 2), k) for k in range(3)):
        cols = sorted((1, *extra))
        coef = np.linalg.lstsq(x[:, cols], t, rcond=None)[0]
        if (coef < 0).any():
            continue
        error = float(((x[:, cols] @ coef - t) ** 2).sum())
        if error < best_error - 1e-15:
            best, best_error = np.zeros(3), error
            best[cols] = coef
    return PrefillCost(*map(float, best))


class FixedChunks:
    """``max_prefill_tokens`` as a number: at most that many prompt tokens per step, over all sequences."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    @property
    def step_tokens(self) -> int:
        """About how many prompt tokens the next step takes (what the scheduler admits requests for)."""
        return self.tokens

    def split(self, wants: list[Row]) -> list[int]:
        """Tokens each prefilling sequence feeds this step, given (tokens left, tokens cached) in admission
        order; once one gets 0 (the budget is spent), so do the rest."""
        out, left = [], self.tokens
        for want, _ in wants:
            n = max(0, min(want, left))
            out.append(n)
            left -= n
        return out

    @contextmanager
    def timing(self, rows: list[Row], device: torch.device) -> Iterator[None]:
        yield


class TimedChunks(FixedChunks):
    """``max_prefill_tokens="auto"``: chunks sized so that a step takes about ``budget_s`` (module docstring)."""

    def __init__(self, budget_s: float, costs: PrefillCosts | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        super().__init__(PROBE_TOKENS)
        self.budget_s, self.costs, self.clock = budget_s, costs or PrefillCosts(), clock

    @property
    def step_tokens(self) -> int:
        cost = self.costs.cost
        return PROBE_TOKENS if cost is None else max(1, self._cap(cost.most_tokens(self.budget_s - cost.fixed, 0)))

    def _cap(self, n: int) -> int:
        return min(n, 2 * max(self.costs.largest, PROBE_TOKENS // 2))

    def split(self, wants: list[Row]) -> list[int]:
        cost = self.costs.cost
        if cost is None:
            return super().split(wants)
        left_s = self.budget_s - cost.fixed
        out, fed = [], 0
        for want, cached in wants:
            n = cost.most_tokens(left_s, cached)
            if not out:  # the first sequence: progress, and not a pass that is all fixed cost
                n = max(n, math.ceil(cost.fixed / max(cost.seconds(1, cached), 1e-12) - 1e-6))
            n = min(want, self._cap(n) - fed)
            n = max(n, 1) if not out else (max(n, 0) if out[-1] else 0)
            out.append(n)
            fed += n
            left_s -= cost.seconds(n, cached)
        return out

    @contextmanager
    def timing(self, rows: list[Row], device: torch.device) -> Iterator[None]:
        """Time the step around the block (the current stream drained, so that its work counts) and learn. Only
        the caller's stream: the SSD speculator times its prefill pieces on its own stream, beside the target's."""
        start = self.clock()
        yield
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self.costs.observe(rows, self.clock() - start)


def prefill_chunks(max_prefill_tokens: int | str, budget_s: float | None, device: torch.device) -> FixedChunks:
    """The chunking a setting asks for: a number fixes it; "auto" times it, with the device's default budget
    unless ``budget_s`` is given."""
    if max_prefill_tokens != "auto":
        return FixedChunks(int(max_prefill_tokens))
    return TimedChunks(budget_s if budget_s is not None else DEFAULT_BUDGET_S.get(device.type, DEFAULT_BUDGET_S["cpu"]))


def check_chunking(max_prefill_tokens: int | str, budget_s: float | None) -> None:
    """``ValueError`` unless ``max_prefill_tokens`` is "auto" or an int >= 1 and the budget (if given) is a positive
    number of seconds."""
    if max_prefill_tokens != "auto" and (isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int)
                                         or max_prefill_tokens < 1):
        raise ValueError(f'max_prefill_tokens must be "auto" or an int >= 1, got {max_prefill_tokens!r}')
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and 0 < budget_s < math.inf):
        raise ValueError(f"prefill_step_budget_s must be a positive number of seconds, got {budget_s!r}")
    if budget_s is not None and max_prefill_tokens != "auto":
        raise ValueError('prefill_step_budget_s sizes the chunks of max_prefill_tokens="auto"; '
                         f"max_prefill_tokens={max_prefill_tokens} fixes them")
