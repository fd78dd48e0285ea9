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
