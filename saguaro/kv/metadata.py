"""Attention metadata: which cache slots each new token writes and may read.

The model sees a flat list of N new tokens (all sequences concatenated). For attention
they are grouped: group ``s`` holds the new tokens of one sequence (or one SSD tree) and
reads the KV slots listed in ``context_slots[s]``, filtered by ``mask[s]``. One general
boolean mask covers causal prefill, decode, K+1-token verification and SSD's tree of
branches alike, so the model has a single attention path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] long: cache slot that each new token's k/v is written to
    query_index: torch.Tensor  # [S, Q] long: index into the N new tokens (padding repeats a valid index)
    query_valid: torch.Tensor  # [S, Q] bool: False on padding; valid entries in row-major order are 0..N-1
    context_slots: torch.Tensor  # [S, L] long: cache slots readable by group s (padding points at slot 0)
    mask: torch.Tensor  # [S, Q, L] bool: True where query q of group s may attend context entry l
    uniform: bool  # every group has the same Q and no padding: reshape instead of gather

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        return AttentionMetadata(
            self.slot_mapping.to(device), self.query_index.to(device), self.query_valid.to(device),
            self.context_slots.to(device), self.mask.to(device), self.uniform)


def build_metadata(context_slots: list[list[int]], query_lens: list[int],
                   masks: list[torch.Tensor] | None = None) -> AttentionMetadata:
    """Group metadata for sequences whose new tokens sit at the end of their context.

    ``context_slots[s]`` lists every slot group ``s`` reads, ending with the slots of its
    ``query_lens[s]`` new tokens (so new tokens write exactly those last slots). Without
    ``masks`` attention is causal; with them ``masks[s]`` is a ``[Q_s, L_s]`` bool tensor.
    """
    if len(context_slots) != len(query_lens):
        raise ValueError("context_slots and query_lens differ in length")
    num_groups = len(query_lens)
    max_q = max(query_lens)
    max_l = max(len(c) for c in context_slots)
    slot_mapping: list[int] = []
    query_index = torch.zeros(num_groups, max_q, dtype=torch.long)
    query_valid = torch.zeros(num_groups, max_q, dtype=torch.bool)
    ctx = torch.zeros(num_groups, max_l, dtype=torch.long)
    mask = torch.zeros(num_groups, max_q, max_l, dtype=torch.bool)
    offset = 0
    for s, (slots, q) in enumerate(zip(context_slots, query_lens)):
        length = len(slots)
        if q < 1 or q > length:
            raise ValueError(f"group {s}: {q} new tokens but {length} context slots")
        slot_mapping.extend(slots[length - q:])
        query_index[s, :q] = torch.arange(offset, offset + q)
        query_index[s, q:] = offset
        query_valid[s, :q] = True
        ctx[s, :length] = torch.tensor(slots, dtype=torch.long)
        if masks is None:
            # query i sits at context position length - q + i and sees everything up to it
            mask[s, :q, :length] = torch.ones(q, length, dtype=torch.bool).tril(length - q)
        else:
            if tuple(masks[s].shape) != (q, length):
                raise ValueError(f"group {s}: mask shape {tuple(masks[s].shape)} != {(q, length)}")
            mask[s, :q, :length] = masks[s]
        mask[s, q:, 0] = True  # padding rows attend somewhere so softmax stays finite
        offset += q
    uniform = all(q == max_q for q in query_lens)
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long), query_index, query_valid,
                             ctx, mask, uniform)
