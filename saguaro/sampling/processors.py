"""Turn logits into the probabilities a request actually samples from.

One function, :func:`probs_from_logits`, applies each row's own temperature, top-k and top-p in a
single vectorized pass, so a batch may mix greedy rows, plain sampling and filtered sampling.

Speculative decoding is exact only if the verifier compares the target and draft distributions that
were *actually sampled from*. Callers therefore run both the target's and the draft's logits through
this same function with the same per-request settings; the verifier then receives the processed
probabilities.

Conventions (all of them are functions of the logit values only, never of sort stability):

* temperature == 0 means greedy: the row is a one-hot at ``torch.argmax(logits)`` (ties go to the
  lowest index).
* top_k == 0 (or top_k >= V) disables top-k. Otherwise every token whose tempered logit is >= the
  k-th largest tempered logit is kept, so ties at the cut-off are all kept and the kept set can
  exceed k.
* top_p == 1 disables top-p. Otherwise, with the probabilities (after top-k) sorted in decreasing
  order, the nucleus is the shortest prefix whose mass is >= top_p; its last (smallest) probability
  is the cut-off and every token with probability >= the cut-off is kept (ties again all kept). The
  top token is always kept.
* The kept probabilities are renormalized to sum to 1; removed tokens are exactly 0.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from saguaro.device import to_device
from saguaro.sampling.params import SamplingParams


class SamplingTensors(NamedTuple):
    """Per-row settings as tensors; unpacks as ``temperature, top_k, top_p``."""

    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1 = off

    @property
    def greedy(self) -> torch.Tensor:
        """[N] bool, True where the row decodes greedily."""
        return self.temperature <= 0


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device | str | None = None
) -> SamplingTensors:
    """Stack a list of :class:`SamplingParams` into the tensors :func:`probs_from_logits` takes."""
    return SamplingTensors(
        temperature=torch.tensor([float(p.temperature) for p in params], dtype=torch.float32, device=device),
        top_k=torch.tensor([int(p.top_k) for p in params], dtype=torch.int64, device=device),
        top_p=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
    )


def probs_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Row-wise temperature, then top-k, then top-p, renormalized (see the module docstring). Long because it
    checks every argument's shape before one vectorized pass over the rows.

    Args:
        logits: [N, V] raw logits (computed in float32).
        temperature: [N]; 0 makes the row greedy (a one-hot at its argmax).
        top_k: [N] integer; 0 disables.
        top_p: [N] in (0, 1]; 1 disables.

    Returns:
        [N, V] float32 probabilities, each row summing to 1.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    logits = logits.float()
    n, vocab = logits.shape
    device = logits.device
    # which filters any row needs is decided on the settings' own device (the host, for the engine), so that
    # logits on a GPU are never waited for here
    greedy_rows = temperature <= 0
    if temperature.numel() == n and bool(greedy_rows.all()):  # every row greedy: the one-hots the end gives them
        return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    any_k = bool(((top_k > 0) & (top_k < vocab) & ~greedy_rows).any())
    any_p = bool(((top_p < 1) & ~greedy_rows).any())
    any_greedy = bool(greedy_rows.any())
    temperature = to_device(temperature.to(torch.float32).reshape(n), device)
    top_k = to_device(top_k.to(torch.int64).reshape(n), device)
    top_p = to_device(top_p.to(torch.float64).reshape(n), device)

    greedy = temperature <= 0
    # shifted so the top logit is 0 before dividing: a tiny temperature sends the others to -inf, never the
    # whole row to inf (whose softmax is NaN); softmax is unchanged by the shift
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    x = shifted / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)

    use_k = (top_k > 0) & (top_k < vocab) & ~greedy
    use_p = (top_p < 1) & ~greedy

    if any_k:
        sorted_x = x.sort(dim=-1, descending=True).values
        kth = sorted_x.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        kth = torch.where(use_k.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))

    probs = torch.softmax(x, dim=-1)

    if any_p:
        sorted_p = probs.sort(dim=-1, descending=True).values
        # Exclusive prefix sums in float64: mass strictly before each sorted position.
        cum = torch.cumsum(sorted_p.double(), dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        # `before` is non-decreasing, so the kept positions form a prefix of length >= 1.
        n_keep = (before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        cutoff = sorted_p.gather(1, (n_keep - 1).unsqueeze(1))
        cutoff = torch.where(use_p.unsqueeze(1), cutoff, torch.zeros_like(cutoff))
        probs = probs.masked_fill(probs < cutoff, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if any_greedy:
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs
