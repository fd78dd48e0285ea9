"""SD with an EAGLE-3 head: chain drafting of K tokens from the target's own features.

Head position p holds (token x_{p+1}, target feature g_p): its logits there predict x_{p+2}. The target's
features reach the proposer through the target runner's tap (``ModelRunner.tap``): after the prefill and
after each verification pass, the rows of each sequence arrive in item order. A round, for a sequence of n
tokens (the target caches positions 0..n-2, whose features the head has or holds pending):
  1. step 1 feeds the pending positions (the prompt after the prefill; the last round's verified positions
     after a round), each with its target feature through ``fc``; the last row's logits give d_1;
  2. steps 2..k feed the last drawn token at the next position with the head's own pre-norm hidden state
     as the feature (EAGLE-3's self-conditioning);
  3. the head's cache rolls back to the positions that had target features, and ``commit`` queues the
     verification pass's features of the accepted positions (x_{n-1}, d_1..d_a) for the next round.
The head keeps its own paged KV cache (one layer). Its distributions live on the target's vocabulary (ids
outside the draft vocabulary get probability 0), so the verifier needs nothing EAGLE-specific.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from saguaro.backends.batch import ForwardItem
from saguaro.backends.dense import dense_metadata
from saguaro.device import to_device
from saguaro.eagle.head import Eagle3Head, layer_config
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.kv.block_manager import BlockManager
from saguaro.kv.kv_cache import KVCache
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.sampler import sample
from saguaro.sd.types import Proposal, Proposer


@dataclass
class HeadState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # head positions written with the target's features
    pending: list[torch.Tensor] = field(default_factory=list)  # features of the next positions, not yet fed
    unverified: torch.Tensor | None = None  # the last verification pass's rows [k+1, A*H_t], until commit

    @property
    def known(self) -> int:
        """Positions whose target features the head has (fed or pending)."""
        return self.num_cached + sum(len(f) for f in self.pending)


class EagleProposer(Proposer):
    def __init__(self, head: Eagle3Head, target: ModelRunner, num_blocks: int, block_size: int):
        self.head = head
        self.device = target.device
        dtype = head.fc.weight.dtype
        self.cache = KVCache(layer_config(head.config), num_blocks, block_size, dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.states: dict[int, HeadState] = {}
        self._next_pass: tuple[str, list[Sequence]] | None = None  # what the target's next pass is for
        target.tap(head.taps, self._observe)

    # -- the target's features ------------------------------------------------------
    def prefill(self, seqs: list[Sequence], ends: list[int] | None = None) -> None:
        """The target prefills ``seqs`` next (a chunk of each, up to ``ends``): its features become the head's
        pending prompt positions, chunk after chunk."""
        self._next_pass = ("prefill", seqs)

    def _observe(self, items: list[ForwardItem], features: torch.Tensor) -> None:
        if self._next_pass is None:
            raise RuntimeError("a target pass the EAGLE proposer did not expect (it announces each one)")
        kind, seqs = self._next_pass
        self._next_pass = None
        for seq, item, rows in zip(seqs, items, features.split([len(i.token_ids) for i in items])):
            state = self._state(seq)
            if item.start != state.known:
                raise RuntimeError(f"target features of sequence {seq.seq_id} arrive from position {item.start}, "
                                   f"the head has them up to {state.known}")
            if kind == "prefill":
                state.pending.append(rows)
            else:
                state.unverified = rows

    # -- drafting -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int], read: bool = True) -> Proposal:
        k_max = max(num_tokens, default=0)
        probs = torch.zeros(len(seqs), max(k_max, 1), self.head.config.vocab_size, device=self.device)
        tokens = torch.zeros(len(seqs), max(k_max, 1), dtype=torch.long, device=self.device)
        active = [b for b, k in enumerate(num_tokens) if k > 0]
        fed: dict[int, int] = {}  # where each head cache rolls back to: its positions with target features
        drawn, hidden = None, None
        for step in range(k_max):
            keep = [i for i, b in enumerate(active) if num_tokens[b] > step]
            active = [active[i] for i in keep]
            if step == 0:
                items, feature = self._first_step(seqs, active)
                fed = {b: self._state(seqs[b]).num_cached for b in active}
            else:  # the last drawn token, with the head's own hidden state as its feature
                items = [self._feed(seqs[b], drawn[i:i + 1]) for b, i in zip(active, keep)]
                feature = hidden[keep]
            hidden = self._run(items, feature)
            rows = [seqs[b] for b in active]
            step_probs = processed_probs(self.head.target_logits(hidden), rows)
            drawn = sample(step_probs, [s.generator for s in rows], torch.tensor([s.params.greedy for s in rows]))
            where = to_device(torch.tensor(active), self.device)
            probs[where, step] = step_probs
            tokens[where, step] = drawn.to(self.device)
        for b, upto in fed.items():  # drop the self-conditioned positions: the target's features replace them
            state = self._state(seqs[b])
            state.num_cached = upto
            self.blocks.truncate(state.block_table, upto)
        self._next_pass = ("verify", seqs)
        counts = [min(k, k_max) for k in num_tokens]
        no_mass = torch.zeros(len(seqs), dtype=torch.bool)
        if not read:
            return Proposal(None, probs, no_mass, device_tokens=tokens, counts=counts)
        return Proposal([row[:n] for row, n in zip(tokens.tolist(), counts)], probs, no_mass)  # the one read

    def _first_step(self, seqs: list[Sequence], active: list[int]) -> tuple[list[ForwardItem], torch.Tensor]:
        """Items feeding each sequence's pending positions (token x_{p+1} at position p), and their features
        through ``fc``."""
        items, features = [], []
        for b in active:
            seq, state = seqs[b], self._state(seqs[b])
            if not state.pending or state.known != seq.num_cached:
                raise RuntimeError(f"sequence {seq.seq_id}: the head has target features up to {state.known}, "
                                   f"the target caches {seq.num_cached} positions")
            start, end = state.num_cached, state.known
            features.append(torch.cat(state.pending))
            state.pending = []
            items.append(self._feed(seq, seq.tokens[start + 1:end + 1]))
        return items, self.head.project(torch.cat(features))

    def _feed(self, seq: Sequence, pending: list[int] | torch.Tensor) -> ForwardItem:
        state = self._state(seq)
        self.blocks.reserve(state.block_table, state.num_cached + len(pending))
        item = ForwardItem(pending, state.num_cached, state.block_table, "last")
        state.num_cached += len(pending)
        return item

    def _run(self, items: list[ForwardItem], feature: torch.Tensor) -> torch.Tensor:
        """The head's pre-norm hidden state at each item's last row [len(items), H]."""
        ids = torch.cat([to_device(torch.as_tensor(i.token_ids, dtype=torch.long), self.device) for i in items])
        positions = to_device(torch.tensor([p for i in items for p in i.positions]), self.device)
        meta = dense_metadata(items, self.blocks.block_size).to(self.device)
        hidden = self.head(ids, positions, feature, self.cache, meta)
        last = torch.tensor([len(i.token_ids) for i in items]).cumsum(0) - 1
        return hidden[to_device(last, self.device)]

    # -- bookkeeping ----------------------------------------------------------------
    def commit(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Queue the verified positions' target features: x_{n-1} and the accepted drafts."""
        state = self._state(seq)
        if state.unverified is None:
            raise RuntimeError(f"sequence {seq.seq_id}: no verification pass to take features from")
        state.pending.append(state.unverified[:num_accepted + 1])
        state.unverified = None

    def _state(self, seq: Sequence) -> HeadState:
        return self.states.setdefault(seq.seq_id, HeadState())

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.blocks.free(state.block_table)
