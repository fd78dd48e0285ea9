"""Paged attention metadata: block tables and per-row visibility, for GPU kernels and CUDA graphs.

The dense ``AttentionMetadata`` (``kv/metadata.py``) lists every slot a group reads and a boolean
mask over them; its size grows with the context, and a CUDA graph, whose buffers have fixed
shapes, cannot hold it. This form is fixed-size per row instead. Row r of the pass (one new token)
reads its group's block table and sees

* the positions ``0 .. prefix_len[r]-1`` of that table (causal rows: up to and including their
  own position; SSD tree rows: the verified prefix up to the branch's fork), then
* the raw cache slots ``extra_slots[r, :extra_len[r]]`` (SSD tree rows: the branch's own tokens,
  which live in scratch slots outside the table; E = 0 for causal passes).

A row with ``prefix_len = 0`` and ``extra_len = 0`` is a ghost: CUDA-graph padding, whose output is
zero and whose ``slot_mapping`` is -1 (its k/v is written nowhere).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from saguaro.backends.batch import ForwardItem
from saguaro.kv.block_manager import slots_for


@dataclass
class PagedMetadata:
    slot_mapping: torch.Tensor  # [N] int64: cache slot each new token's k/v is written to; -1 = ghost row
    block_tables: torch.Tensor  # [S, MB] int32: block ids of each group; entries past its length unused
    row_group: torch.Tensor  # [N] int32: the block-table row that query row r reads
    prefix_len: torch.Tensor  # [N] int32: table positions 0..prefix_len[r]-1 are visible to row r
    extra_slots: torch.Tensor  # [N, E] int64: further visible slots (E may be 0); padding is 0
    extra_len: torch.Tensor  # [N] int32: how many of extra_slots[r] are valid
    block_size: int

    @property
    def num_rows(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_extras(self) -> int:
        return self.extra_slots.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "block_size"}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PagedMetadata":
        moved = {name: t.to(device, non_blocking=non_blocking) for name, t in self.tensors().items()}
        return PagedMetadata(**moved, block_size=self.block_size)


def build_paged_metadata(block_tables: list[list[int]], row_group: list[int], prefix_len: list[int],
                         slot_mapping: list[int], extra_slots: list[list[int]] | None, block_size: int
                         ) -> PagedMetadata:
    """Host tensors (CPU) for one pass; rows are listed in pass order. ``extra_slots`` None means E = 0."""
    n = len(row_group)
    if not (len(prefix_len) == len(slot_mapping) == n):
        raise ValueError("row_group, prefix_len and slot_mapping need one entry per row")
    widest = max((len(t) for t in block_tables), default=0)
    tables = torch.zeros(len(block_tables), max(widest, 1), dtype=torch.int32)
    for g, table in enumerate(block_tables):
        tables[g, :len(table)] = torch.tensor(table, dtype=torch.int32)
    groups, visible = torch.tensor(row_group, dtype=torch.int32), torch.tensor(prefix_len, dtype=torch.int32)
    covered = torch.tensor([len(t) * block_size for t in block_tables], dtype=torch.int32)
    if n and bool((visible > covered[groups.long()]).any()):
        raise ValueError("a row sees more positions than its block table covers")
    e = max((len(x) for x in extra_slots), default=0) if extra_slots else 0
    extras = torch.zeros(n, e, dtype=torch.int64)
    lens = torch.zeros(n, dtype=torch.int32)
    if extra_slots:
        for r, x in enumerate(extra_slots):
            extras[r, :len(x)] = torch.tensor(x, dtype=torch.int64)
            lens[r] = len(x)
    return PagedMetadata(torch.tensor(slot_mapping, dtype=torch.int64), tables, groups, visible, extras, lens,
                         block_size)


def paged_metadata(items: list[ForwardItem], block_size: int) -> PagedMetadata:
    """The paged form of a pass (``backends/batch.py``), as host tensors; the runner moves them to the
    device (or into a graph's buffers)."""
    tables, groups, visible, writes = [], [], [], []
    extras: list[list[int]] = []
    any_tree = any(item.tree is not None for item in items)
    for g, item in enumerate(items):
        tables.append(item.block_table)
        n = len(item.token_ids)
        groups += [g] * n
        if item.tree is None:
            visible += range(item.start + 1, item.start + n + 1)
            writes += slots_for(item.block_table, item.start, item.start + n, block_size)
            extras += [[] for _ in range(n)]
        else:
            visible += item.tree.visible
            writes += item.tree.write_slots
            extras += item.tree.extra_slots
    return build_paged_metadata(tables, groups, visible, writes, extras if any_tree else None, block_size)
