"""What one forward pass computes, before any backend turns it into metadata.

A pass is a list of ``ForwardItem``s, one per sequence (or per SSD tree of branches). Causal items
are a run of new tokens at the end of a sequence: prefill, decode, the K+1 rows of a verification,
a draft step. Each new token sits at the next position, writes its k/v into the sequence's block
table, and sees every position up to its own.

Tree items (``TreeRows``) are the rows of one SSD branch step: every row is one branch of the same
sequence. A row's k/v goes to a scratch slot outside the block table (``write_slots``), and the row
sees the first ``visible[i]`` positions of the block table (the verified prefix up to its fork) plus
its own earlier steps (``extra_slots[i]``, which end with its write slot). This is the paper's tree
mask (Appendix D), stated per row so that a backend needs neither a dense mask nor a gathered context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # hints only
    from saguaro.eagle.features import FeatureLog


@dataclass
class TreeRows:
    positions: list[int]  # [n] position of each row's token
    write_slots: list[int]  # [n] cache slot each row's k/v is written to
    visible: list[int]  # [n] block-table positions 0..visible[i]-1 that row i sees
    extra_slots: list[list[int]]  # [n][*] further slots row i sees, ending with write_slots[i]

    def __post_init__(self) -> None:
        n = len(self.positions)
        if not (len(self.write_slots) == len(self.visible) == len(self.extra_slots) == n):
            raise ValueError("tree rows need one position, write slot, visible length and extra list each")
        if any(not e or e[-1] != w for e, w in zip(self.extra_slots, self.write_slots)):
            raise ValueError("each tree row's extra slots must end with its own write slot")


@dataclass
class ForwardItem:
    token_ids: list[int] | torch.Tensor  # new tokens (causal ones at start..start+n-1); a device tensor when a
    # draft step feeds back the tokens it just sampled without the host reading them
    start: int
    block_table: list[int]  # must already cover start + n positions (a tree item: its visible prefix)
    logits: str = "last"  # "last", "all" or "none"
    tree: TreeRows | None = None  # SSD branch rows instead of a causal run
    # the sequence's target features, for a draft that reads them (an EAGLE-3 head); other models ignore it
    features: FeatureLog | None = None

    def __post_init__(self) -> None:
        if self.logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {self.logits!r}")
        if self.tree is not None and len(self.tree.positions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.tree.positions)} tree rows")

    @property
    def positions(self) -> list[int]:
        if self.tree is not None:
            return self.tree.positions
        return list(range(self.start, self.start + len(self.token_ids)))

    def logit_rows(self) -> range:
        """Rows of this item (0-based within it) whose logits the caller wants."""
        n = len(self.token_ids)
        return {"last": range(n - 1, n), "all": range(n), "none": range(0)}[self.logits]
