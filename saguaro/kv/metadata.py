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
                   masks: list[torch.Tensor] | None = None,
                   padded_mask: torch.Tensor | None = None) -> AttentionMetadata:
    """Group metadata for sequences whose new tokens sit at the end of their context.

    ``context_slots[s]`` lists every slot group ``s`` reads, ending with the slots of its
    ``query_lens[s]`` new tokens (so new tokens write exactly those last slots). Without
    ``masks`` attention is causal; with them ``masks[s]`` is a ``[Q_s, L_s]`` bool tensor.
    ``padded_mask`` gives every group's mask at once, [S, max Q, max L], False outside each group's
    Q_s x L_s (it is written to: padding rows get column 0).
    Built with a handful of batched tensor ops: this runs once per forward pass, for
    batches of thousands of sequences in the distribution tests.
    """
    if len(context_slots) != len(query_lens):
        raise ValueError("context_slots and query_lens differ in length")
    lengths = [len(c) for c in context_slots]
    for s, (q, length) in enumerate(zip(query_lens, lengths)):
        if q < 1 or q > length:
            raise ValueError(f"group {s}: {q} new tokens but {length} context slots")
    max_q, max_l = max(query_lens), max(lengths)
    slot_mapping = [slot for slots, q in zip(context_slots, query_lens) for slot in slots[len(slots) - q:]]
    ctx = torch.tensor([c + [0] * (max_l - len(c)) for c in context_slots], dtype=torch.long)
    q_lens = torch.tensor(query_lens)
    l_lens = torch.tensor(lengths)
    q_idx = torch.arange(max_q)
    query_valid = q_idx[None, :] < q_lens[:, None]
    starts = torch.cumsum(q_lens, 0) - q_lens
    query_index = starts[:, None] + torch.where(query_valid, q_idx[None, :], 0)
    if padded_mask is not None:
        if tuple(padded_mask.shape) != (len(query_lens), max_q, max_l):
            raise ValueError(f"padded mask shape {tuple(padded_mask.shape)} != {(len(query_lens), max_q, max_l)}")
        mask = padded_mask
    elif masks is None:
        # query i of group s sits at context position L_s - Q_s + i and sees everything up to it
        last_visible = (l_lens - q_lens)[:, None] + q_idx[None, :]
        mask = torch.arange(max_l)[None, None, :] <= last_visible[:, :, None]
        mask &= query_valid[:, :, None]
    else:
        mask = torch.zeros(len(query_lens), max_q, max_l, dtype=torch.bool)
        for s, (q, length) in enumerate(zip(query_lens, lengths)):
            if tuple(masks[s].shape) != (q, length):
                raise ValueError(f"group {s}: mask shape {tuple(masks[s].shape)} != {(q, length)}")
            mask[s, :q, :length] = masks[s]
    mask[:, :, 0] |= ~query_valid  # padding rows attend somewhere so softmax stays finite
    uniform = all(q == max_q for q in query_lens)
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long), query_index, query_valid,
                             ctx, mask, uniform)
