"""Attention layout for decoding every cache branch of a sequence in one pass per step.

For one sequence with verified prefix length ``L`` and a speculation d_1..d_K already
"glued" into the draft cache (positions L..L+K-1), a branch is an outcome (k, t): it forks
after d_k, its root token t sits at position L+k, and step j of the branch sits at L+k+j.

Branches are ordered most likely first, and step j decodes only the first ``widths[j]`` of
them (a non-increasing list: a tapered tree, so the likeliest branches get longer cached
speculations for the price of a few narrow steps). Branch tokens live in scratch slots laid
out step-major: step j of branch q (q < widths[j]) is ``scratch[offsets[j] + q]`` with
``offsets[j] = widths[0] + ... + widths[j-1]``. At step j every decoded branch reads the prefix
up to its fork (positions < L+k) and its own steps 0..j; this is the paper's custom tree
mask (Appendix D). ``step_item`` states it per row for the runner (each row sees the block table up
to its fork, then its own scratch slots); ``step_inputs`` spells the same visibility out as a dense
mask over one context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from saguaro.backends.batch import ForwardItem, TreeRows


@dataclass
class BranchLayout:
    prefix_slots: list[int]  # slots of positions 0..L+K-1 (verified tokens, then the glued speculation)
    verified_len: int  # L
    fork_depths: list[int]  # k for each branch q, most likely branch first
    roots: list[int]  # the guessed bonus token t of each branch q
    widths: list[int] = field(default_factory=list)  # branches decoded at each step; [] = all, every step
    scratch_slots: list[int] = field(default_factory=list)  # len >= scratch_size(steps), step-major
    block_table: list[int] = field(default_factory=list)  # the draft's table; prefix_slots are its first slots

    def __post_init__(self) -> None:
        if any(w < 1 for w in self.widths) or any(a < b for a, b in zip(self.widths, self.widths[1:])):
            raise ValueError(f"branch widths must be positive and non-increasing, got {self.widths}")
        # scratch offsets of the listed steps, so offset() is O(1) for every branch token of a build
        self._starts = list(accumulate((min(self.num_branches, w) for w in self.widths), initial=0))

    @property
    def num_branches(self) -> int:
        return len(self.fork_depths)

    def width(self, step: int) -> int:
        """How many branches step ``step`` decodes (the first ones)."""
        return min(self.num_branches, self.widths[step] if step < len(self.widths) else self.num_branches)

    def offset(self, step: int) -> int:
        """Scratch index of step ``step``'s first slot (the slots of the steps before it come first)."""
        listed = min(step, len(self.widths))
        return self._starts[listed] + (step - listed) * self.num_branches

    def step_offsets(self, steps: int) -> list[int]:
        """``offset(j)`` for j < ``steps``: branch q's slot of step j is ``scratch_slots[offsets[j] + q]``."""
        return [self.offset(j) for j in range(steps)]

    def scratch_size(self, steps: int) -> int:
        return self.offset(steps)

    def step_inputs(self, step: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Context slots, positions and [width, ctx] mask for decoding step ``step`` of its branches."""
        n = self.width(step)
        end = self.offset(step + 1)
        prefix = len(self.prefix_slots)
        context = self.prefix_slots + self.scratch_slots[:end]
        depths = torch.tensor(self.fork_depths[:n])
        mask = torch.zeros(n, prefix + end, dtype=torch.bool)
        mask[:, :prefix] = torch.arange(prefix)[None, :] < (self.verified_len + depths)[:, None]
        rows = torch.arange(n)
        for j in range(step + 1):  # branch q's own token of step j (every earlier step decoded all n of them)
            mask[rows, prefix + self.offset(j) + rows] = True
        positions = (self.verified_len + depths + step).tolist()
        return context, positions, mask

    def step_item(self, step: int, tokens: list[int]) -> ForwardItem:
        """The forward item decoding step ``step`` of the first ``width(step)`` branches, fed ``tokens``."""
        n = self.width(step)
        if len(tokens) != n:
            raise ValueError(f"step {step} decodes {n} branches, got {len(tokens)} tokens")
        forks = [self.verified_len + k for k in self.fork_depths[:n]]
        offsets, slots = self.step_offsets(step + 1), self.scratch_slots
        own = [[slots[o + q] for o in offsets] for q in range(n)]
        rows = TreeRows([f + step for f in forks], [slots[-1] for slots in own], forks, own)
        return ForwardItem(tokens, self.verified_len, self.block_table, "all", tree=rows)
