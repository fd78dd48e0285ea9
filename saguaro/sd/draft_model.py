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
``keep_ranked`` > 0 also records each step's most likely ids and their probabilities, left on the device
(``Proposal.rank_table`` and ``rank_rows``).
``graphs=False`` keeps every step a pass of the runner (a draft whose passes read more than tokens: the SSD
speculator's EAGLE-3 head).
``state_of`` (optional) finds a sequence's draft cache where its owner keeps it: the SSD speculator keeps
it with the rest of the sequence's state and frees it itself. By default the proposer keeps one per
sequence id (``states``), rolled back by ``commit`` and freed by ``release``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from saguaro.device import to_device
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.ranked import RankTable, rank_table
from saguaro.sampling.sampler import sample
from saguaro.sd.draft_graph import StepsShape, steps_graph
from saguaro.sd.types import Proposal, Proposer

if TYPE_CHECKING:  # hints only
    from saguaro.eagle.features import FeatureLog


@dataclass
class DraftState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    features: FeatureLog | None = None  # the target's features, for a draft that reads them (SSD's EAGLE-3 head)


Reweight = Callable[[torch.Tensor, int, list[Sequence]], torch.Tensor]  # (probs [N, V], step j, rows) -> probs


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, reweight: Reweight | None = None, keep_ranked: int = 0,
                 state_of: Callable[[Sequence], DraftState] | None = None, graphs: bool = True):
        self.runner = runner
        self.reweight = reweight
        self.keep_ranked = keep_ranked
        self.states: dict[int, DraftState] = {}  # the draft caches this proposer keeps (no ``state_of``)
        self._state_of = state_of
        # greedy rounds' steps 2..K as one graph replay on the paged backend (``draft_graph.py``); all K steps where
        # ranked ids are kept (SSD's just-in-time drafts) and every draft cache lacks only its sequence's last token
        self.steps_graph = steps_graph(runner) if reweight is None and graphs else None

    def propose(self, seqs: list[Sequence], num_tokens: list[int], read: bool = True) -> Proposal:
        """Draft ``num_tokens[b]`` tokens for each sequence, one draft pass per step. The drawn tokens stay on
        the draft's device: each step feeds the last step's tokens straight back in, and the host reads them
        all once, after the last step (on a GPU the steps then queue up without waiting for each other).
        ``read=False`` skips that read: SD's verifier takes the tokens on the device and reads them with its
        outcome."""
        k_max = max(num_tokens, default=0)
        graphed = self._graphed(seqs, num_tokens, k_max)
        if graphed is not None:
            return self._propose_graphed(seqs, k_max, graphed, read)
        vocab = self.runner.config.vocab_size
        probs = torch.zeros(len(seqs), max(k_max, 1), vocab, device=self.runner.device)
        steps: list[tuple[list[int], torch.Tensor]] = []  # per step: the rows drafting, their tokens [rows]
        tables: list[RankTable] = []
        active = [b for b, k in enumerate(num_tokens) if k > 0]
        drawn = None
        for step in range(k_max):
            keep = [i for i, b in enumerate(active) if num_tokens[b] > step]
            active = [active[i] for i in keep]
            if step == 0:
                items = [self._feed(seqs[b], seqs[b].tokens[self._state(seqs[b]).num_cached:]) for b in active]
            else:  # the last step's tokens, fed back where they were drawn
                items = [self._feed(seqs[b], drawn[i:i + 1]) for b, i in zip(active, keep)]
            logits = torch.cat(self.runner.forward(items))
            rows = [seqs[b] for b in active]
            step_probs = processed_probs(logits, rows)
            if self.reweight is not None:
                step_probs = self.reweight(step_probs, step, rows)
            greedy = torch.tensor([s.params.greedy for s in rows])
            drawn = sample(step_probs, [s.generator for s in rows], greedy)
            probs[to_device(torch.tensor(active), probs.device), step] = step_probs
            steps.append((active, drawn))
            if self.keep_ranked:
                tables.append(rank_table(logits, self.keep_ranked))
        # every row's drafts as one [B, max(K, 1)] table on the draft's device (row b's first num_tokens[b])
        on_device = torch.zeros(len(seqs), max(k_max, 1), dtype=torch.long, device=probs.device)
        for step, (rows_, drawn_) in enumerate(steps):
            on_device[to_device(torch.tensor(rows_), probs.device), step] = drawn_.to(probs.device)
        counts = [min(k, k_max) for k in num_tokens]
        table, rank_rows = None, None
        if self.keep_ranked:  # row i of step j's table ranks token j of the step's i-th drafting sequence
            table = RankTable.cat(tables) if tables else RankTable.empty(self.keep_ranked, probs.device)
            rank_rows = [[] for _ in seqs]
            done = 0
            for rows_, _ in steps:
                for i, b in enumerate(rows_):
                    rank_rows[b].append(done + i)
                done += len(rows_)
        no_mass = torch.zeros(len(seqs), dtype=torch.bool)
        if not read:
            return Proposal(None, probs, no_mass, device_tokens=on_device, counts=counts, rank_table=table,
                            rank_rows=rank_rows)
        # the one read from the device
        tokens = [row[:n] for row, n in zip(on_device.tolist(), counts)] if steps else [[] for _ in seqs]
        return Proposal(tokens, probs, no_mass, rank_table=table, rank_rows=rank_rows)

    def _graphed(self, seqs: list[Sequence], num_tokens: list[int], k_max: int) -> StepsShape | None:
        """The steps graph's shape for this round, or None where it runs step by step: not every sequence greedy
        at the same K (of at least 2 for SD's steps 2..K), a block table past the graph's, or, keeping ranked ids,
        a draft cache that lacks more than its sequence's last token."""
        if (self.steps_graph is None or not seqs or any(k != k_max for k in num_tokens)
                or not all(s.params.greedy for s in seqs)):
            return None
        if any(len(s.tokens) + k_max - 1 > self.steps_graph.table_width * self.runner.block_size for s in seqs):
            return None
        if self.keep_ranked and any(self._state(s).num_cached != len(s.tokens) - 1 for s in seqs):
            return None
        return self.steps_graph.shape(len(seqs), k_max, min(self.keep_ranked, self.runner.config.vocab_size))

    def _propose_graphed(self, seqs: list[Sequence], k: int, shape: StepsShape, read: bool) -> Proposal:
        """``propose`` for a greedy round: the first step as a pass, steps 2..K as one replay; or all K steps as
        one replay (``shape.first``), their ranked ids kept."""
        first = None
        if not shape.first:
            items = [self._feed(seq, seq.tokens[self._state(seq).num_cached:]) for seq in seqs]
            first = torch.cat(self.runner.forward(items)).argmax(dim=-1)  # greedy rows: ``sample``'s one-hot argmax
        rows = []
        for seq in seqs:
            state = self._state(seq)
            fed = k - (first is not None)  # positions the graph feeds, from its first step's
            self.runner.blocks.reserve(state.block_table, state.num_cached + fed)
            rows.append([1, state.num_cached, seq.tokens[-1]] + state.block_table
                        + [0] * (shape.table_width - len(state.block_table)))
            state.num_cached += fed
        out = self.steps_graph.run(shape, first, rows)
        n = len(seqs)
        on_device = out.tokens[:n].clone() if first is None else torch.cat([first[:, None], out.tokens[:n]], dim=1)
        vocab = self.runner.config.vocab_size
        probs = torch.zeros(n, k, vocab, device=on_device.device).scatter_(2, on_device[..., None], 1.0)
        no_mass = torch.zeros(n, dtype=torch.bool)
        table, rank_rows = None, None
        if shape.ranked:  # row b * K + j ranks token j of sequence b
            table = RankTable(out.rank_ids[:n].reshape(n * k, -1), out.rank_probs[:n].reshape(n * k, -1))
            rank_rows = [list(range(b * k, (b + 1) * k)) for b in range(n)]
        if not read:
            return Proposal(None, probs, no_mass, device_tokens=on_device, counts=[k] * n, rank_table=table,
                            rank_rows=rank_rows)
        return Proposal(on_device.tolist(), probs, no_mass, rank_table=table, rank_rows=rank_rows)

    def prefill(self, seqs: list[Sequence], ends: list[int] | None = None) -> None:
        """Feed every token but the last, or up to ``ends[i]`` of a chunked prefill (``propose`` starts from
        the last one, which yields the first draft's logits)."""
        upto = [len(seq) - 1 if ends is None else min(end, len(seq) - 1) for seq, end in zip(seqs, ends or seqs)]
        items = [self._feed(seq, seq.tokens[self._state(seq).num_cached:end], "none") for seq, end in zip(seqs, upto)]
        items = [item for item in items if item.token_ids]
        if items:
            self.runner.forward(items)

    def backlog(self, seq: Sequence) -> int:
        return len(seq.tokens) - self._state(seq).num_cached

    def _state(self, seq: Sequence) -> DraftState:
        if self._state_of is not None:
            return self._state_of(seq)
        return self.states.setdefault(seq.seq_id, DraftState())

    def _feed(self, seq: Sequence, pending: list[int] | torch.Tensor, logits: str = "last") -> ForwardItem:
        """The forward item writing ``pending`` after the draft's cached tokens (blocks reserved, counted)."""
        state = self._state(seq)
        self.runner.blocks.reserve(state.block_table, state.num_cached + len(pending))
        item = ForwardItem(pending, state.num_cached, state.block_table, logits, features=state.features)
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
