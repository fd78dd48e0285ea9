"""Exact rejection sampling: the verifier's half of speculative decoding.

Terms, for one row (one sequence) in one verification round
-----------------------------------------------------------
The speculator proposed ``n = num_draft[b]`` **draft tokens** ``d_1 .. d_n`` (``0 <= n <= K``).
``q_i`` is the draft distribution ``d_i`` was sampled from, and ``p_i`` is the target distribution at
the same position, computed by one target forward pass over the context extended by ``d_1 .. d_{i-1}``.
There are ``n + 1`` target distributions ``p_1 .. p_{n+1}``; ``p_{n+1}`` follows the whole draft. Both ``p`` and
``q`` are the *processed* distributions (after temperature, top-k and top-p), i.e. the ones actually
sampled from.

* **Accepted tokens** are the longest prefix ``d_1 .. d_k`` of drafts that pass their tests. Given
  that every earlier draft passed, ``d_i`` passes with probability ``min(1, p_i(d_i) / q_i(d_i))``.
  Testing stops at the first failure; drafts after it are discarded even if they would pass.
  ``k`` (``num_accepted``) is between 0 and ``n``.
* **Recovered (residual) token**: when ``d_{k+1}`` is rejected (``k < n``), the token emitted in its
  place is drawn from the **residual distribution** ``r(x) = max(p_{k+1}(x) - q_{k+1}(x), 0) / Z``. It is
  never ``d_{k+1}`` itself when ``q_{k+1}(d_{k+1}) > 0``, since a rejection implies
  ``p_{k+1}(d_{k+1}) < q_{k+1}(d_{k+1})``.
* **Bonus token** ``t*`` (the paper's name, Definition of a verification outcome): the one token
  emitted after the accepted prefix. It is the recovered token when a draft was rejected, and a
  fresh draw from ``p_{n+1}`` when all ``n`` drafts were accepted (the residual of an empty draft is
  ``p_{n+1}`` itself). Every round therefore emits ``k + 1 >= 1`` tokens: the accepted drafts, then
  ``t*``. The pair ``(k, t*)`` is the verification outcome sent to the speculator.

Why the output is distributed exactly as the target: for one position,
``P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x) = min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x)``,
because ``P(reject) = 1 - sum_x min(p, q) = Z``. Induction over positions gives the joint law.

Special rows
------------
* **Point-mass drafts** (``point_mass[b]``: an n-gram or other deterministic proposer with no
  distribution): ``q_i`` is a one-hot at ``d_i``. So ``d_i`` is accepted with probability
  ``p_i(d_i)`` and the residual is ``p_i`` with ``d_i`` removed, renormalized. This is exact for any
  proposal chosen independently of the verifier's random numbers.
* **Greedy rows** (``greedy[b]``): the temperature -> 0 limit. ``d_i`` is accepted iff it equals
  ``argmax p_i`` (ties: lowest index), and ``t*`` is ``argmax p_{k+1}``. No random numbers are drawn.

Randomness
----------
A non-greedy row draws exactly ``num_draft[b] + 1`` float64 uniforms, in one call, from its own
generator (see :mod:`saguaro.sampling.sampler` for the shared stream used by rows whose generator is
``None``, or by every row when ``generators`` is ``None``): the ``i``-th decides ``d_i``, the last
drives the draw of ``t*``. The count does not depend on the outcome, so a seeded request's stream does
not depend on the other rows of the batch. Acceptance is tested as ``u * q_i(d_i) < p_i(d_i)`` in
float64, which needs no division and has probability exactly ``min(1, p/q)`` for ``u`` uniform on
[0, 1). Inputs are renormalized in float64 first, so float32 rounding in their sums has no effect.

Guards: a draft with ``q_i(d_i) = 0`` (impossible for a sampled token) is rejected; a residual with
no mass (``p_{k+1} <= q_{k+1}`` everywhere, which makes acceptance certain, so only reachable through the
previous guard) falls back to ``p_{k+1}``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.device import to_device
from saguaro.sampling.sampler import Generators, inverse_cdf, row_uniforms


@dataclass
class VerifyResult:
    """Outcome of one verification round, per row."""

    num_accepted: list[int]  # k: accepted drafts, 0 <= k <= num_draft
    bonus_tokens: list[int]  # t*: the token emitted after the accepted prefix
    output_tokens: list[list[int]]  # accepted drafts followed by t* (length k + 1)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return x / x.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)


def rejection_sample_tensors(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    point_mass: torch.Tensor | None,
    generators: Generators,
    greedy: torch.Tensor,
    shared_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`rejection_sample`, but returns ``(num_accepted [B], bonus_tokens [B])`` as int64 tensors.
    Long because it checks every argument's shape before the one vectorized accept / reject pass."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got {tuple(target_probs.shape)}")
    batch, k_plus_1, vocab = target_probs.shape
    k_max = k_plus_1 - 1
    device = target_probs.device
    if tuple(draft_tokens.shape) != (batch, k_max):
        raise ValueError(f"draft_tokens must be [{batch}, {k_max}], got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k_max, vocab):
        raise ValueError(f"draft_probs must be [{batch}, {k_max}, {vocab}], got {tuple(draft_probs.shape)}")
    # the per-row settings are checked, and the random draws counted, where the caller holds them (the host,
    # for the engine) before they join the probabilities' device: nothing here waits for a GPU
    num_draft = num_draft.to(torch.int64).reshape(batch)
    if batch and (int(num_draft.min()) < 0 or int(num_draft.max()) > k_max):
        raise ValueError(f"num_draft must lie in [0, {k_max}]")
    greedy = greedy.to(torch.bool).reshape(batch)
    if point_mass is None:
        point_mass = torch.full((batch,), draft_probs is None, dtype=torch.bool)
    point_mass = point_mass.to(torch.bool).reshape(batch)
    if draft_probs is None and not bool(point_mass.all()):
        raise ValueError("rows without point_mass need draft_probs")
    if bool(greedy.all()):  # no row draws: the drafts against the argmax alone
        return _greedy_outcome(target_probs, draft_tokens, num_draft)
    counts = torch.where(greedy, 0, num_draft + 1).tolist()
    num_draft, greedy, point_mass = (to_device(t, device) for t in (num_draft, greedy, point_mass))

    rows = torch.arange(batch, device=device)
    p = _normalize(target_probs)  # [B, K+1, V]
    p_argmax = p.argmax(dim=-1)  # [B, K+1]
    valid = torch.arange(k_max, device=device).unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    d = torch.where(valid, to_device(draft_tokens.to(torch.int64), device), 0)  # padding -> token 0

    # Probabilities of each drafted token under the target and under the draft.
    p_d = p[:, :k_max].gather(2, d.unsqueeze(2)).squeeze(2)  # [B, K]
    q = _normalize(draft_probs) if draft_probs is not None else None
    q_d = q.gather(2, d.unsqueeze(2)).squeeze(2) if q is not None else torch.ones_like(p_d)
    q_d = torch.where(point_mass.unsqueeze(1), torch.ones_like(q_d), q_d)

    u = torch.zeros(batch, k_plus_1, dtype=torch.float64, device=device)
    drawn = row_uniforms(counts, generators, shared_generator, device=device)
    u[:, : drawn.shape[1]] = drawn

    accept_random = (u[:, :k_max] * q_d < p_d) & (q_d > 0)
    accept_greedy = d == p_argmax[:, :k_max]
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept_random) & valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # length of the accepted prefix

    # Distribution of t*: the residual at the first rejection, else p at the position after the draft.
    p_next = p[rows, num_accepted]  # [B, V] p_{k+1} (tensor index k: columns count from 0)
    dist = p_next
    if k_max > 0:
        j = num_accepted.clamp(max=k_max - 1)
        residual = p_next.scatter(1, d[rows, j].unsqueeze(1), 0.0)  # point mass: p without the draft
        if q is not None:
            residual = torch.where(point_mass.unsqueeze(1), residual, (p_next - q[rows, j]).clamp_min(0.0))
        use_residual = (num_accepted < num_draft) & (residual.sum(dim=1) > 0)
        dist = torch.where(use_residual.unsqueeze(1), residual, p_next)
    bonus = inverse_cdf(dist, u.gather(1, num_draft.unsqueeze(1)).squeeze(1))
    bonus = torch.where(greedy, p_argmax[rows, num_accepted], bonus)
    return num_accepted, bonus


def _greedy_outcome(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample_tensors`` when every row is greedy: ``d_i`` is accepted iff it is ``argmax p_i``, and
    ``t*`` is the argmax after the accepted prefix (the greedy branch of the general pass, without the draws,
    the normalization and the residuals it would compute and discard)."""
    device, k_max = target_probs.device, target_probs.shape[1] - 1
    p_argmax = target_probs.argmax(dim=-1)  # [B, K+1]
    num_draft = to_device(num_draft, device)
    valid = torch.arange(k_max, device=device).unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    accept = (to_device(draft_tokens.to(torch.int64), device) == p_argmax[:, :k_max]) & valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return num_accepted, p_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    point_mass: torch.Tensor | None,
    generators: Generators,
    greedy: torch.Tensor,
    shared_generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify a batch of drafts against the target (see the module docstring for the terms).

    Args:
        target_probs: [B, K+1, V] processed target distributions; row ``b`` uses positions
            ``0 .. num_draft[b]``.
        draft_tokens: [B, K] int64; row ``b`` uses its first ``num_draft[b]`` entries (the rest is
            padding and may hold anything).
        draft_probs: [B, K, V] processed draft distributions the tokens were sampled from, or ``None``
            when every row is a point-mass draft.
        num_draft: [B] int64, drafts per row, in ``0 .. K``.
        point_mass: [B] bool, rows whose draft has no distribution (treated as one-hot at the
            drafted token); ``None`` means all rows when ``draft_probs`` is ``None``, else none.
        generators: per-row generators; ``None`` entries, or ``None`` for the whole list, use
            ``shared_generator``.
        greedy: [B] bool, rows verified by exact argmax match (no randomness).
        shared_generator: stream for rows without their own generator; ``None`` means the default
            generator of ``target_probs``' device.

    Returns:
        A :class:`VerifyResult` with ``k``, ``t*`` and the ``k + 1`` emitted tokens of every row.
    """
    num_accepted, bonus = rejection_sample_tensors(
        target_probs, draft_tokens, draft_probs, num_draft, point_mass, generators, greedy, shared_generator
    )
    # the round's one read from the device: k, t* and the drafts (which may still be on the device too)
    table = torch.cat([num_accepted[:, None], bonus[:, None], draft_tokens.to(num_accepted.device)], dim=1)
    rows = table.tolist()
    k_list, bonus_list = [r[0] for r in rows], [r[1] for r in rows]
    outputs = [r[2:2 + r[0]] + [r[1]] for r in rows]
    return VerifyResult(num_accepted=k_list, bonus_tokens=bonus_list, output_tokens=outputs)
