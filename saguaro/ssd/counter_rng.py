"""Uniforms from a counter-based generator: a hash of (request seed, counter), computed where the draws are used.

Why: a graph of the speculator's build (``graph_build.py``) cannot call a host generator once per request, and
a seeded request must still draw the same numbers run to run whatever it is batched with. A hash of its seed and
of a counter that names the draw (the branch token's position, fork depth, branch and step) gives exactly that,
as a few integer ops on any device, with no state to advance. The Python build draws the same numbers where the
graph build is in use, so the two give the same tokens.

The hash is SplitMix64's finalizer (Steele, Lea and Flood 2014), applied twice: int64 arithmetic wraps on every
torch device, and right shifts are made logical by masking the sign bits an arithmetic shift brings in.
"""
from __future__ import annotations

import torch

_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per element of ``seeds`` and ``counters`` (int64, broadcast together), with
    53 random bits: draws of different counters under one seed, or of different seeds, are independent."""
    x = _mix(seeds.to(torch.int64) * _GAMMA + _mix(counters.to(torch.int64) + _GAMMA))
    return _shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def branch_counter(verified_len: torch.Tensor, depth: torch.Tensor, branch: torch.Tensor, step: int
                   ) -> torch.Tensor:
    """The counter naming a build's draw: step ``step`` of branch ``branch``, which forks at ``depth`` after a
    verified prefix of ``verified_len`` tokens. Distinct across a build, and across builds (the prefix grows every
    round) for K < 64 and fewer than 1,024 branches per sequence."""
    return ((verified_len.to(torch.int64) * 64 + depth) * 1024 + branch) * 64 + step
