"""Exact, per-request-reproducible sampling from processed probabilities.

Randomness model
----------------
Every row draws its random numbers from *its own* ``torch.Generator`` when it has one (a request with a
seed), so the tokens a seeded request gets do not depend on which other requests share the batch, on
their order, or on the batch size. Rows without a generator (``None`` entries, or ``generators=None``
for the whole batch) share one generator, ``shared_generator`` (the host's default generator when
that is ``None`` as well); they draw in one call, in row order. The shared mode is what unseeded
requests use, and it lets tests run tens of thousands of independent trials as one batch.

Uniforms are drawn on the host, where the requests' generators live, whatever device the
probabilities are on, and reach it by an asynchronous copy: a request's stream is the same on every
device, and drawing never waits for the GPU.

Greedy rows take the argmax and consume no randomness at all.

Why inverse-CDF with one uniform per row
----------------------------------------
A row costs one random number however large the vocabulary is, so a per-row generator call is cheap
and a request's random stream advances by a fixed, small amount per token (an exponential race would
need V numbers per row). The uniform is float64 (53 random bits), so tokens with tiny probability are
not rounded away, and the CDF is accumulated in float64. The draw is exact: a token with probability
0 adds nothing to the CDF, so the search can never stop on it, and the rare case where rounding puts
the uniform at or past the CDF's end is mapped to the last token with non-zero probability.
"""
from __future__ import annotations

from typing import Sequence

import torch

from saguaro.device import to_device

Generators = Sequence[torch.Generator | None] | None


def row_uniforms(
    counts: Sequence[int],
    generators: Generators,
    shared_generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw ``counts[b]`` float64 uniforms in [0, 1) for each row ``b``, each from its own stream.

    Row ``b`` uses ``generators[b]`` when it is not ``None`` (one call of ``counts[b]`` numbers);
    all other rows draw from ``shared_generator`` in a single call, in row order.

    Returns:
        [N, max(counts)] float64 on ``device``; entries past ``counts[b]`` are 0 and meaningless.
    """
    n = len(counts)
    if generators is not None and len(generators) != n:
        raise ValueError(f"got {len(generators)} generators for {n} rows")
    width = max(counts, default=0)
    out = torch.zeros(n, width, dtype=torch.float64)
    if width == 0:
        return out if device is None else out.to(device)
    counts_t = torch.tensor(list(counts), dtype=torch.int64)
    own = torch.zeros(n, dtype=torch.bool)
    if generators is not None:
        own = torch.tensor([g is not None for g in generators], dtype=torch.bool)
    drawn = torch.arange(width).unsqueeze(0) < counts_t.unsqueeze(1)
    shared_mask = drawn & ~own.unsqueeze(1)
    total = int(shared_mask.sum())
    if total:
        shared_device = shared_generator.device if shared_generator is not None else "cpu"
        flat = torch.rand(total, generator=shared_generator, dtype=torch.float64, device=shared_device)
        out[shared_mask] = flat.cpu()  # boolean-mask assignment fills in row-major order
    if generators is not None:
        _fill_own_streams(out, counts, counts_t, generators)
    return out if device is None else to_device(out, torch.device(device))


def _fill_own_streams(out: torch.Tensor, counts: Sequence[int], counts_t: torch.Tensor,
                      generators: Sequence[torch.Generator | None]) -> None:
    """Rows with their own generator: one draw per generator for all of its rows (a sequence's branches share
    its generator), its numbers handed to those rows in row order. Drawing n numbers at once gives the same
    numbers as n draws of one, so every row gets exactly what a draw of its own would give."""
    rows_of: dict[int, tuple[torch.Generator, list[int]]] = {}
    for b, g in enumerate(generators):
        if g is not None and counts[b] > 0:
            entry = rows_of.get(id(g))
            if entry is None:
                rows_of[id(g)] = (g, [b])
            else:
                entry[1].append(b)
    if not rows_of:
        return
    draws = [torch.rand(sum(counts[b] for b in rows), generator=g, dtype=torch.float64, device=g.device).cpu()
             for g, rows in rows_of.values()]
    order = torch.tensor([b for _, rows in rows_of.values() for b in rows], dtype=torch.int64)  # as drawn
    n_each = counts_t[order]
    row = order.repeat_interleave(n_each)
    first = (torch.cumsum(n_each, 0) - n_each).repeat_interleave(n_each)  # each row's first draw, per draw
    col = torch.arange(len(row)) - first
    out[row, col] = torch.cat(draws)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Map one uniform per row to a token through the row's CDF.

    Args:
        probs: [N, V] non-negative weights (need not sum to 1; each row needs positive mass).
        u: [N] uniforms in [0, 1).

    Returns:
        [N] int64: the first token whose cumulative weight exceeds ``u * total``. Tokens of weight 0
        are never returned.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    total = cdf[:, -1:].contiguous()
    if u.device != probs.device or u.dtype != torch.float64:  # no call at all inside a graph's capture
        u = u.to(device=probs.device, dtype=torch.float64)
    target = u.reshape(-1, 1) * total
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at (or past) the end of the CDF, where the search returns V. Use the
    # first position at which the CDF reaches its total instead: the CDF rises there, so it has mass.
    last = torch.searchsorted(cdf, total, right=False).squeeze(1)
    return torch.where(idx >= probs.shape[-1], last, idx)


def sample(
    probs: torch.Tensor,
    generators: Generators,
    greedy: torch.Tensor,
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from processed probabilities.

    Args:
        probs: [N, V] probabilities (e.g. from ``probs_from_logits``).
        generators: per-row generators (``None`` entries use the shared stream), or ``None`` to put
            every row on the shared stream.
        greedy: [N] bool; these rows return ``argmax(probs)`` and draw no random numbers.
        shared_generator: the shared stream; ``None`` means the host's default generator.

    Returns:
        [N] int64 token ids.
    """
    n = probs.shape[0]
    counts = [0 if g else 1 for g in greedy.reshape(n).tolist()]  # greedy lives on the host: no GPU wait
    tokens = probs.argmax(dim=-1)
    if any(counts):
        u = row_uniforms(counts, generators, shared_generator, device=probs.device)[:, 0]
        tokens = torch.where(to_device(greedy.reshape(n), probs.device), tokens, inverse_cdf(probs, u))
    return tokens
