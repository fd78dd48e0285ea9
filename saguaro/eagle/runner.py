"""The EAGLE-3 head as the SSD speculator's draft runner.

The speculator drives its draft through the draft runner's interface (``DraftRunner``: ``forward`` over
``ForwardItem``s, a paged KV cache with its ``BlockManager``, ``slots``), in token positions: feeding token
x_p at position p gives the draft's guess for x_{p+1}. ``EagleRunner`` keeps that contract for a head, whose
row for x_p reads a feature for position p-1 (proposer.py's head position p-1):
  * the target's g_{p-1} when the sequence's ``FeatureLog`` (``ForwardItem.features``) holds it: every
    verified position;
  * else the head's own pre-norm hidden state at x_{p-1}'s row (self-conditioning): the speculation under
    verification and every branch of a build, up to 2K+1 positions past the verified ones. Such a row needs
    its parent's output first, so a causal item's self-conditioned rows run one per head pass ("waves"),
    each wave batching every item's next row; a tree step's rows have their parents from earlier passes.
Token position 0 has no row (no feature precedes it). The row of x_p is written at block-table position
p-1, inside what the speculator reserves in token positions. Every row's pre-norm hidden state is kept by
KV slot (``hidden``), where later passes find their parents: the previous position's slot, or a branch's
previous scratch slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.backends.batch import ForwardItem, TreeRows
from saguaro.backends.dense import dense_metadata
from saguaro.device import to_device
from saguaro.eagle.features import FeatureLog
from saguaro.eagle.head import Eagle3Head, layer_config
from saguaro.engine.draft_runner import DraftRunner
from saguaro.kv.block_manager import BlockManager
from saguaro.kv.kv_cache import KVCache


@dataclass
class _Piece:
    """Some rows of one item, in one head pass."""
    item: ForwardItem  # in head positions (token position - 1)
    slots: list[int]  # each row's KV slot
    targets: list[int]  # per row: the position of its target feature, or -1 (self-conditioned)
    parents: list[int]  # per row: the slot of the row whose hidden state is its feature (self-conditioned rows)
    log: FeatureLog | None


class EagleRunner(DraftRunner):
    """The head behind the draft runner's interface (see the module docstring)."""
    reads_features = True  # the speculator sends it the target's features and keeps only rows built on them

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int, device: torch.device | str):
        self.head = head
        self.config = layer_config(head.config)  # vocab_size: the target's (the logits live on its vocabulary)
        self.device = torch.device(device)
        dtype = head.fc.weight.dtype
        self.cache = KVCache(self.config, num_blocks, block_size, dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self._none = num_blocks * block_size  # a slot no row writes: position 0's (zero) hidden state
        self.hidden = torch.zeros(self._none + 1, head.config.hidden_size, dtype=dtype, device=self.device)

    def capture_graphs(self, max_rows: int | None = None, extras: tuple[int, ...] = (0,)) -> None:
        """Nothing to capture: the head runs eagerly."""

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def forward_flat(self, items: list[ForwardItem]) -> tuple[torch.Tensor | None, list[int]]:
        """The wanted rows' logits over the target's vocabulary [R, V] (items in order), with each wanting item's
        row count; every row's k/v and hidden state written."""
        waves: list[list[_Piece]] = []
        wanted, counts = [], []
        for item in items:
            slots, pieces = self._tree_pieces(item) if item.tree is not None else self._causal_pieces(item)
            for wave, piece in pieces:
                waves += [[] for _ in range(wave + 1 - len(waves))]
                waves[wave].append(piece)
            rows = item.logit_rows()
            wanted += [slots[r] for r in rows]
            if item.logits != "none":
                counts.append(len(rows))
        for wave in waves:
            self._run(wave)
        if not wanted:
            return None, counts
        return self.head.target_logits(self.hidden[to_device(torch.tensor(wanted), self.device)]), counts

    def _causal_pieces(self, item: ForwardItem) -> tuple[list[int], list[tuple[int, _Piece]]]:
        """The target-featured rows in wave 0, then each self-conditioned row one wave after its parent."""
        positions, log = item.positions, item.features
        known = len(log) if log is not None else 0
        first = next((i for i, p in enumerate(positions) if p > 0), len(positions))
        slots = [self._none] * first + self.slots(item.block_table, positions[first] - 1, positions[-1]) \
            if first < len(positions) else [self._none] * len(positions)
        pieces = []
        targeted = [i for i in range(first, len(positions)) if positions[i] - 1 < known]
        if targeted:
            a, b = targeted[0], targeted[-1] + 1
            pieces.append((0, self._piece(item, a, b, slots[a:b], [p - 1 for p in positions[a:b]], [-1] * (b - a),
                                                log)))
        wave = 0 if not targeted else 1
        for i in range(first + len(targeted), len(positions)):
            p = positions[i]
            if p < 2:
                raise RuntimeError(f"the EAGLE-3 head has no feature for position {p - 1}: the target's features "
                                   "of this sequence never arrived")
            parent = slots[i - 1] if i > first else self.slots(item.block_table, p - 2, p - 1)[0]
            pieces.append((wave, self._piece(item, i, i + 1, slots[i:i + 1], [-1], [parent], log)))
            wave += 1
        return slots, pieces

    @staticmethod
    def _piece(item: ForwardItem, a: int, b: int, slots: list[int], targets: list[int], parents: list[int],
               log: FeatureLog | None) -> _Piece:
        """Rows a..b-1 of a causal ``item``, as an item of their own in head positions."""
        return _Piece(ForwardItem(item.token_ids[a:b], item.positions[a] - 1, item.block_table, "none"), slots,
                      targets, parents, log)

    def _tree_pieces(self, item: ForwardItem) -> tuple[list[int], list[tuple[int, _Piece]]]:
        """A tree step: every row in wave 0, its parent the branch's previous row (at step 0, the fork's)."""
        tree, log = item.tree, item.features
        known = len(log) if log is not None else 0
        if min(tree.positions) < 2:
            raise RuntimeError("a branch of the EAGLE-3 head's tree starts before position 2")
        targets = [p - 1 if p - 1 < known else -1 for p in tree.positions]
        parents = [e[-2] if len(e) > 1 else self.slots(item.block_table, p - 2, p - 1)[0]
                   for e, p in zip(tree.extra_slots, tree.positions)]
        rows = TreeRows([p - 1 for p in tree.positions], tree.write_slots, [v - 1 for v in tree.visible],
                        tree.extra_slots)
        shifted = ForwardItem(item.token_ids, item.start, item.block_table, "none", tree=rows)
        return list(tree.write_slots), [(0, _Piece(shifted, list(tree.write_slots), targets, parents, log))]

    def _run(self, pieces: list[_Piece]) -> None:
        """One head pass over ``pieces``: their features (the target's through ``fc``, in one call; the parents'
        hidden states, in one gather), then their hidden states into ``hidden``."""
        items = [p.item for p in pieces]
        ids = torch.cat([to_device(torch.as_tensor(i.token_ids, dtype=torch.long), self.device) for i in items])
        positions = to_device(torch.tensor([q for i in items for q in i.positions]), self.device)
        spans, targeted, parents, fed = [], [], [], []
        offset = 0
        for p in pieces:
            for r, (t, parent) in enumerate(zip(p.targets, p.parents)):
                if t >= 0:  # a piece's target rows are consecutive positions: one view of its log each
                    if not spans or spans[-1][0] is not p.log or spans[-1][2] != t:
                        spans.append([p.log, t, t])
                    spans[-1][2] = t + 1
                    targeted.append(offset + r)
                else:
                    parents.append(parent)
                    fed.append(offset + r)
            offset += len(p.slots)
        feature = torch.empty(len(ids), self.hidden.shape[1], dtype=self.hidden.dtype, device=self.device)
        if targeted:
            rows = torch.cat([log.span(a, b) for log, a, b in spans])
            feature[to_device(torch.tensor(targeted), self.device)] = self.head.project(rows)
        if fed:
            feature[to_device(torch.tensor(fed), self.device)] = \
                self.hidden[to_device(torch.tensor(parents), self.device)]
        meta = dense_metadata(items, self.block_size).to(self.device)
        hidden = self.head(ids, positions, feature, self.cache, meta)
        self.hidden[to_device(torch.tensor([s for p in pieces for s in p.slots]), self.device)] = hidden
