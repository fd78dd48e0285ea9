"""The draft model as a synchronous speculator (the paper's SD baseline).

The draft keeps its own paged KV cache. ``prefill`` feeds it the prompt while the target
prefills (SD counts the draft's prompt prefill in the time to first token, as a serving engine
does). Each ``propose`` first feeds the draft every token it has not yet seen (the tokens the
last round appended, or the whole prompt without a prefill), then decodes K tokens one step at
a time, sampling each from the sequence's processed draft distribution. ``commit`` rolls the draft cache back to the
accepted prefix, so no rejected token's k/v survives and no block leaks.

``reweight`` (optional) transforms the distribution step j is drawn from, and the proposal
records the transformed one: the SSD worker passes Saguaro sampling (Def. 14,
``saguaro.ssd.saguaro_sampling``) so just-in-time drafts follow the same law as cached ones.
``keep_ranked`` > 0 also records each step's most likely ids and their probabilities (``Proposal.ranked``).
``state_of`` (optional) finds a sequence's draft cache where its owner keeps it: the SSD speculator keeps
it with the rest of the sequence's state and frees it itself. By default the proposer keeps one per
sequence id (``states``), rolled back by ``commit`` and freed by ``release``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.sampler import sample
from saguaro.spec.types import Proposal, Proposer, Ranked, rank_positions


@dataclass
class DraftState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0


Reweight = Callable[[torch.Tensor, int, list[Sequence]], torch.Tensor]  # (probs [N, V], step j, rows) -> probs


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, reweight: Reweight | None = None, keep_ranked: int = 0,
                 state_of: Callable[[Sequence], DraftState] | None = None):
        self.runner = runner
        self.reweight = reweight
        self.keep_ranked = keep_ranked
        self.states: dict[int, DraftState] = {}  # the draft caches this proposer keeps (no ``state_of``)
        self._state_of = state_of

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        k_max = max(num_tokens, default=0)
        vocab = self.runner.config.vocab_size
        tokens: list[list[int]] = [[] for _ in seqs]
        ranked: list[list[Ranked]] = [[] for _ in seqs]
        probs = torch.zeros(len(seqs), max(k_max, 1), vocab)
        active = [b for b, k in enumerate(num_tokens) if k > 0]
        for step in range(k_max):
            active = [b for b in active if num_tokens[b] > step]
            items = []
            for b in active:
                seq = seqs[b]
                items.append(self._feed(seq, seq.tokens[self._state(seq).num_cached:] if step == 0
                                        else [tokens[b][-1]]))
            logits = torch.cat(self.runner.forward(items))
            rows = [seqs[b] for b in active]
            step_probs = processed_probs(logits, rows)
            if self.reweight is not None:
                step_probs = self.reweight(step_probs, step, rows)
            greedy = torch.tensor([s.params.greedy for s in rows])
            drawn = sample(step_probs, [s.generator for s in rows], greedy).tolist()
            top = rank_positions(logits, self.keep_ranked) if self.keep_ranked else None
            for i, b in enumerate(active):
                tokens[b].append(drawn[i])
                probs[b, step] = step_probs[i]
                if top is not None:
                    ranked[b].append(top[i])
        return Proposal(tokens, probs, torch.zeros(len(seqs), dtype=torch.bool),
                        ranked if self.keep_ranked else None)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Feed every token but the last (``propose`` starts from the last one, which yields the first
        draft's logits)."""
        items = [self._feed(seq, seq.tokens[self._state(seq).num_cached:len(seq) - 1], "none") for seq in seqs]
        items = [item for item in items if item.token_ids]
        if items:
            self.runner.forward(items)

    def _state(self, seq: Sequence) -> DraftState:
        if self._state_of is not None:
            return self._state_of(seq)
        return self.states.setdefault(seq.seq_id, DraftState())

    def _feed(self, seq: Sequence, pending: list[int], logits: str = "last") -> ForwardItem:
        """The forward item writing ``pending`` after the draft's cached tokens (blocks reserved, counted)."""
        state = self._state(seq)
        self.runner.blocks.reserve(state.block_table, state.num_cached + len(pending))
        item = ForwardItem(pending, state.num_cached, state.block_table, logits)
        state.num_cached += len(pending)
        return item

    def commit(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Keep the k/v of the accepted drafts only (the last draft was never fed back)."""
        state = self.states.get(seq.seq_id)
        if state is None or num_drafted == 0:
            return
        state.num_cached -= (num_drafted - 1) - min(num_accepted, num_drafted - 1)
        self.runner.blocks.truncate(state.block_table, state.num_cached)

    def release(self, seq: Sequence) -> None:
        self.drop(seq.seq_id)

    def drop(self, seq_id: int) -> None:
        """Free the draft cache kept for ``seq_id``, if any."""
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.runner.blocks.free(state.block_table)
