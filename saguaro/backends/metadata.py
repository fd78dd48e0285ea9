"""Pass preparation: a pass's ``ForwardItem``s as the metadata each backend's model reads.

Both forms describe the same attention (``backends/batch.py``): ``dense`` lists the slots each
item reads with a boolean mask (the eager reference and the CPU kernels), ``paged`` gives block
tables and per-row visibility (the GPU path and its CUDA graphs). Tests hold the two equal.
"""
from __future__ import annotations

import torch

from saguaro.backends.batch import ForwardItem
from saguaro.kv.block_manager import slots_for
from saguaro.kv.metadata import AttentionMetadata, build_metadata
from saguaro.kv.paged_metadata import PagedMetadata, build_paged_metadata


def dense(items: list[ForwardItem], block_size: int) -> AttentionMetadata:
    """Causal items read their block table up to their last new token. A tree item reads its table up to
    its widest row's fork, then every row's extra slots, arranged so that the context ends with the rows'
    write slots in row order (``build_metadata`` takes the last slots as the ones written)."""
    contexts, masks, causal = [], [], True
    for item in items:
        if item.tree is None:
            contexts.append(slots_for(item.block_table, 0, item.start + len(item.token_ids), block_size))
            masks.append(None)
            continue
        causal = False
        context, mask = _tree_context(item, block_size)
        contexts.append(context)
        masks.append(mask)
    q_lens = [len(i.token_ids) for i in items]
    if causal:
        return build_metadata(contexts, q_lens)
    for s, (item, mask) in enumerate(zip(items, masks)):
        if mask is None:  # a causal item beside tree items: its causal mask, spelled out
            n, length = q_lens[s], len(contexts[s])
            masks[s] = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    return build_metadata(contexts, q_lens, masks)


def _tree_context(item: ForwardItem, block_size: int) -> tuple[list[int], torch.Tensor]:
    tree = item.tree
    n = len(tree.positions)
    prefix = max(tree.visible)
    earlier = [e[:-1] for e in tree.extra_slots]  # each row's earlier steps, then every row's write slot
    flat = [slot for e in earlier for slot in e]
    context = slots_for(item.block_table, 0, prefix, block_size) + flat + list(tree.write_slots)
    rows = torch.arange(n)
    owner = torch.repeat_interleave(rows, torch.tensor([len(e) for e in earlier], dtype=torch.long))
    mask = torch.zeros(n, len(context), dtype=torch.bool)
    mask[:, :prefix] = torch.arange(prefix)[None, :] < torch.tensor(tree.visible)[:, None]
    mask[:, prefix:prefix + len(flat)] = owner[None, :] == rows[:, None]
    mask[rows, prefix + len(flat) + rows] = True
    return context, mask


def paged(items: list[ForwardItem], block_size: int) -> PagedMetadata:
    """Host tensors of the paged form; the runner moves them to the device (or into a graph's buffers)."""
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
