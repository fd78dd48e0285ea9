"""Attention layout for decoding every cache branch of a sequence in one pass.

For one sequence with verified prefix length ``L`` and a speculation d_1..d_K already
"glued" into the draft cache (positions L..L+K-1), a branch is an outcome (k, t): it forks
after d_k, its root token t sits at position L+k, and step j of the branch sits at L+k+j.
Branch tokens live in scratch slots laid out step-major: ``scratch[j * n + q]`` holds step j
of branch q. At step j every branch reads the prefix up to its fork (positions
< L+k) and its own steps 0..j; this is the paper's custom tree mask (Appendix D).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BranchLayout:
    prefix_slots: list[int]  # slots of positions 0..L+K-1 (verified tokens, then the glued speculation)
    verified_len: int  # L
    fork_depths: list[int]  # k for each branch q
    roots: list[int]  # the guessed bonus token t of each branch q
    scratch_slots: list[int] = field(default_factory=list)  # len >= steps * n_branches, step-major

    @property
    def num_branches(self) -> int:
        return len(self.fork_depths)

    def step_inputs(self, step: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Context slots, positions and [n, ctx] mask for decoding step ``step`` of every branch."""
        n = self.num_branches
        prefix = len(self.prefix_slots)
        context = self.prefix_slots + self.scratch_slots[:(step + 1) * n]
        depths = torch.tensor(self.fork_depths)
        mask = torch.zeros(n, prefix + (step + 1) * n, dtype=torch.bool)
        mask[:, :prefix] = torch.arange(prefix)[None, :] < (self.verified_len + depths)[:, None]
        own = torch.eye(n, dtype=torch.bool)
        for j in range(step + 1):
            mask[:, prefix + j * n: prefix + (j + 1) * n] = own
        positions = (self.verified_len + depths + step).tolist()
        return context, positions, mask
