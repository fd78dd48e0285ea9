"""One staging buffer per graph: a replay's per-row fields packed on the host, moved in one copy.

Why: a replay used to copy its input ids, positions and five metadata tensors one by one, each a pinned
host-to-device copy with its own launch. Here the host packs them into one pinned int64 buffer, one copy
moves it, and the graph itself unpacks it into its typed static buffers (the unpack is captured with the
forward, so it costs no launch of its own).

Layout of a graph of B rows, E extra slots per row and block tables MB wide (int64, in this order):

    ids [B] | positions [B] | slot_mapping [B] | row_group [B] | prefix_len [B] | extra_len [B]
    | extra_slots [B, E] | block_tables [B, MB]

Rows past the pass's N are ghosts (slot -1, nothing visible, token 0 at position 0). Block tables come
last and only the pass's S groups are copied, so a replay moves ``6 B + B E + S MB`` integers; table
entries past a group's length are never read, so what an earlier pass left there is harmless.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.backends.paged.metadata import PagedMetadata

ROW_FIELDS = ("ids", "positions", "slot_mapping", "row_group", "prefix_len", "extra_len")
GHOST = {"ids": 0, "positions": 0, "slot_mapping": -1, "row_group": 0, "prefix_len": 0, "extra_len": 0}


@dataclass(frozen=True)
class StagingLayout:
    rows: int  # B
    extras: int  # E
    table_width: int  # MB

    @property
    def extra_offset(self) -> int:
        return len(ROW_FIELDS) * self.rows

    @property
    def table_offset(self) -> int:
        return self.extra_offset + self.rows * self.extras

    @property
    def size(self) -> int:
        return self.table_offset + self.rows * self.table_width

    def row_field(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        i = ROW_FIELDS.index(name) * self.rows
        return buf[i:i + self.rows]

    def extra_slots(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.extra_offset:self.table_offset].view(self.rows, self.extras)

    def block_tables(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.table_offset:self.size].view(self.rows, self.table_width)

    def pack(self, buf: torch.Tensor, input_ids: torch.Tensor | None, positions: torch.Tensor,
             meta: PagedMetadata) -> int:
        """Write a pass of N <= B rows into the host buffer ``buf`` [size], ghosts padding it to B; returns how many
        leading elements hold it (what to copy). ``input_ids`` None leaves the ids field as it is (the caller
        feeds device-resident ids itself)."""
        n, (groups, width) = meta.num_rows, meta.block_tables.shape
        if n > self.rows or meta.max_extras != self.extras or width > self.table_width:
            raise ValueError(f"a pass of {n} rows, {meta.max_extras} extra slots and tables {width} wide does not "
                             f"fit a graph of {self.rows} rows, {self.extras} extras and tables {self.table_width}")
        values = {"ids": input_ids, "positions": positions, "slot_mapping": meta.slot_mapping,
                  "row_group": meta.row_group, "prefix_len": meta.prefix_len, "extra_len": meta.extra_len}
        for name in ROW_FIELDS:
            if values[name] is None:
                continue
            field = self.row_field(buf, name)
            field[:n] = values[name]
            field[n:] = GHOST[name]
        if self.extras:
            self.extra_slots(buf)[:n] = meta.extra_slots
        self.block_tables(buf)[:groups, :width] = meta.block_tables
        return self.table_offset + groups * self.table_width

    def unpack(self, buf: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata) -> None:
        """Copy the staged fields (the ids excepted) into a graph's typed static buffers; all on one device."""
        positions.copy_(self.row_field(buf, "positions"))
        for name in ROW_FIELDS[2:]:
            getattr(meta, name).copy_(self.row_field(buf, name))
        if self.extras:
            meta.extra_slots.copy_(self.extra_slots(buf))
        meta.block_tables.copy_(self.block_tables(buf))
