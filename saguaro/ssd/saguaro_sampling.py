"""Saguaro sampling (paper Def. 14) on batched draft distributions, where the speculator draws tokens.

The token at index j of a speculation (d_{j+1}) is drawn from

    q_j = sigma_{F_j, C}(z) ~ C * p(t) for t in top_{F_j}(p),  p(t) otherwise   (renormalized),

where p is the draft's *processed* distribution (temperature, top-k, top-p) and F_j = fan_out[j] is the
fan-out the cache will use at depth j: if d_{j+1} is rejected, the bonus token comes from the residual
max(p_target - q_j, 0), which lowering C pushes onto the cached top-F_j tokens (Thm 15; with the engine's
exclude-the-drafted-token rule the monotonicity can fail, see ``saguaro.theory.hit_tradeoff``).

Exactness: the verifier is handed exactly q_j (not p), so rejection sampling stays lossless for any C.
C = 1 and F_j = 0 are no-ops; greedy rows are left alone (their one-hot has nothing to move); a row whose
mass lies entirely in its top-F_j with C = 0 cannot be renormalized and is kept as p (still exact, since
what is recorded is what was sampled from). The NumPy reference is ``saguaro.theory.saguaro_probs``;
``tests/test_saguaro_sampling.py`` checks this tensor version against it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from saguaro.engine.sequence import Sequence


def saguaro_reweight(probs: torch.Tensor, fan_out: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Def. 14 row by row: multiply the top-``fan_out[n]`` entries of ``probs[n]`` by ``c[n]``, renormalize.

    Args:
        probs: [N, V] probabilities (rows sum to 1).
        fan_out: [N] int, F for each row (0 = unchanged).
        c: [N] float in [0, 1] (1 = unchanged).
    Returns a new [N, V] tensor; rows that would lose all their mass are returned unchanged.
    """
    fan_out = fan_out.to(torch.int64).clamp(min=0, max=probs.shape[-1])
    c = c.to(probs.dtype)
    active = (fan_out > 0) & (c < 1)
    if not bool(active.any()):
        return probs
    f_max = int(fan_out[active].max())
    top = probs.topk(f_max, dim=-1).indices  # [N, f_max]
    in_top = torch.arange(f_max)[None, :] < fan_out[:, None]
    scale = torch.where(in_top & active[:, None], c[:, None], torch.ones((), dtype=probs.dtype))
    out = probs.clone()
    out.scatter_(1, top, probs.gather(1, top) * scale)
    total = out.sum(dim=-1, keepdim=True)
    ok = total > 1e-12
    return torch.where(ok, out / total.clamp(min=1e-30), probs)


@dataclass
class SaguaroSampling:
    """What the speculator applies at step j for a batch of rows (one sequence per row).

    ``fan_out(seq)`` gives the K+1 fan-outs the cache will use for this sequence's speculation; ``c(seq)`` its
    down-weighting constant. Both are per sequence so that a plan can depend on temperature and batch size.
    """
    fan_out: Callable[[Sequence], list[int]]
    c: Callable[[Sequence], float]

    def apply(self, probs: torch.Tensor, step: int, seqs: list[Sequence]) -> torch.Tensor:
        cs, fs = [], []
        for s in seqs:
            c = 1.0 if s.params.greedy else self.c(s)
            cs.append(c)
            f = self.fan_out(s) if c < 1.0 else []
            fs.append(f[min(step, len(f) - 1)] if f else 0)
        if all(c >= 1.0 for c in cs):
            return probs
        return saguaro_reweight(probs, torch.tensor(fs), torch.tensor(cs))
