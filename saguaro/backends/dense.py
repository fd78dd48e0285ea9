"""The dense backends: the exact eager reference and the bf16 CPU kernels.

Both read ``AttentionMetadata`` (every slot a group reads, and a boolean mask). The eager model
gathers each group's context and runs SDPA with the mask; it is the reference every other path is
tested against, and what ``enforce_eager=True`` runs. The CPU kernels (``backends/cpu_kernels/model.py``)
read the same metadata from C++. ``dense_metadata`` builds that form from a pass; tests hold it
equal to the paged form (``backends/paged/metadata.py``).
"""
from __future__ import annotations

import torch

from saguaro.backends.base import Backend
from saguaro.backends.batch import ForwardItem
from saguaro.device import to_device
from saguaro.kv.block_manager import slots_for
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata, build_metadata


class DenseBackend(Backend):
    def __init__(self, net, device: torch.device, name: str):
        super().__init__(net, device)
        self.name = name

    def prepare(self, items: list[ForwardItem], block_size: int) -> AttentionMetadata:
        return dense_metadata(items, block_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        dev = self.device
        hidden = self.net(to_device(input_ids, dev), to_device(positions, dev), cache, meta.to(dev))
        if logit_rows.numel() == 0:
            return None
        return self.net.logits(hidden[to_device(logit_rows, dev)])


def dense_metadata(items: list[ForwardItem], block_size: int) -> AttentionMetadata:
    """The dense form (``kv/metadata.py``) of a pass (``backends/batch.py``).

    Causal items read their block table up to their last new token. A tree item reads its table up to
    its widest row's fork, then every row's extra slots, arranged so that the context ends with the rows'
    write slots in row order (``build_metadata`` takes the last slots as the ones written)."""
    if all(item.tree is None for item in items):
        contexts = [slots_for(i.block_table, 0, i.start + len(i.token_ids), block_size) for i in items]
        return build_metadata(contexts, [len(i.token_ids) for i in items])
    contexts, rows = [], _RowSight()
    for s, item in enumerate(items):
        n = len(item.token_ids)
        if item.tree is None:  # a causal item beside tree items: row i sees its context up to its own slot
            length = item.start + n
            contexts.append(slots_for(item.block_table, 0, length, block_size))
            rows.add(s, range(length - n + 1, length + 1), [0] * n, [0] * n, [-1] * n)
            continue
        tree = item.tree
        prefix = max(tree.visible)
        flat: list[int] = []  # every row's earlier steps, row after row, then every row's write slot
        starts, ends = [], []
        for extra in tree.extra_slots:
            starts.append(prefix + len(flat))
            flat.extend(extra[:-1])
            ends.append(prefix + len(flat))
        contexts.append(slots_for(item.block_table, 0, prefix, block_size) + flat + list(tree.write_slots))
        own = prefix + len(flat)
        rows.add(s, tree.visible, starts, ends, range(own, own + n))
    q_lens = [len(i.token_ids) for i in items]
    return build_metadata(contexts, q_lens, padded_mask=rows.mask(len(items), max(q_lens),
                                                                   max(len(c) for c in contexts)))


class _RowSight:
    """What each query row of a pass sees, as columns of its group's context: the first ``visible`` ones, the
    run [start, end) (a tree row's earlier steps) and column ``own`` (its write slot; -1: none). Collected
    row by row as plain lists, then turned into the [S, Q, L] mask with a few tensor ops for the whole pass
    (a build step of the speculator has thousands of tree items)."""

    def __init__(self) -> None:
        self.group: list[int] = []
        self.index: list[int] = []
        self.visible: list[int] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.own: list[int] = []

    def add(self, group: int, visible, start, end, own) -> None:
        n = len(start)
        self.group += [group] * n
        self.index += range(n)
        self.visible += visible
        self.start += start
        self.end += end
        self.own += own

    def mask(self, groups: int, max_q: int, max_l: int) -> torch.Tensor:
        col = torch.arange(max_l)[None, :]
        visible, start, end, own = (torch.tensor(x, dtype=torch.long)[:, None]
                                    for x in (self.visible, self.start, self.end, self.own))
        sight = (col < visible) | ((col >= start) & (col < end)) | (col == own)  # [rows, L]
        mask = torch.zeros(groups, max_q, max_l, dtype=torch.bool)
        mask[torch.tensor(self.group), torch.tensor(self.index)] = sight
        return mask
