"""Synchronous speculative decoding: propose K, verify K+1 in one target pass, roll back.

One round, per sequence with n tokens (the target caches the first n-1):
  1. the proposer drafts k <= K tokens d_1..d_k;
  2. the target runs once over [x_n, d_1..d_k] at positions n-1..n-1+k, giving k+1
     distributions;
  3. rejection sampling keeps a prefix d_1..d_a and draws one bonus token;
  4. both caches roll back to the accepted prefix (target: n + a cached tokens).
"""
from __future__ import annotations

import time

import torch

from saguaro.engine.k_schedule import FixedK, KSchedule
from saguaro.engine.decoder import Decoder
from saguaro.device import to_device
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sampling.batch import processed_probs
from saguaro.sampling.logit_processors import apply_logit_processors
from saguaro.sampling.logprobs import record_logprobs
from saguaro.sd.types import Proposal, Proposer
from saguaro.verify.rejection import VerifyResult, rejection_sample


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts worth proposing: a round yields at most k+1 tokens, so stay within limits."""
    remaining = seq.params.max_tokens - len(seq.output_ids)
    return max(0, min(k, remaining - 1, max_model_len - len(seq) - 1))


def verify_round(target: ModelRunner, seqs: list[Sequence], proposal: Proposal) -> VerifyResult:
    """Score the drafts with one target pass, rejection-sample, and roll the target cache back. Drafts may
    still be on the draft's device (``proposal.device_tokens``): they feed the target pass and the verifier
    there, and the verifier's one read brings them to the host with the outcome."""
    counts = proposal.num_drafts()
    draft_tokens, items = _round_items(target, seqs, proposal, counts)
    logits, rows = target.forward_flat(items)  # [sum of k_b + 1, V] on the target's device
    logits = apply_logit_processors(logits, seqs, rows, draft_tokens)  # row j follows the drafts d_1..d_j
    if max(counts, default=0) == 0 and all(s.params.greedy for s in seqs):
        # an AR step (every K chosen 0): each row's argmax, what rejection sampling gives a greedy row without
        # drafts, read at once
        bonus = logits.argmax(dim=-1).tolist()
        result = VerifyResult([0] * len(seqs), bonus, [[t] for t in bonus])
    else:
        result = _judge(logits, seqs, rows, proposal, draft_tokens, counts)
    record_logprobs(logits, seqs, rows, result.output_tokens)  # the emitted tokens' own rows: no extra pass
    for seq, drafted, accepted in zip(seqs, counts, result.num_accepted):
        seq.num_cached += 1 + accepted  # x_n and the accepted drafts; rejected k/v is dropped
        target.blocks.truncate(seq.block_table, seq.num_cached)
        seq.spec.record(drafted, accepted)
    return result


def _round_items(target: ModelRunner, seqs: list[Sequence], proposal: Proposal, counts: list[int]
                 ) -> tuple[torch.Tensor, list[ForwardItem]]:
    """The drafts as a [B, max(K, 1)] table (on the draft's device when they are still there) and the target
    pass's items: each sequence's last token and its drafts."""
    if proposal.tokens is not None:
        width = max(max(counts, default=0), 1)
        draft_tokens = torch.tensor([[*d, *[0] * (width - len(d))] for d in proposal.tokens], dtype=torch.long)
        draft_tokens = draft_tokens.view(len(seqs), width)  # also for an empty batch
        items = [ForwardItem([seq.last_token] + drafts, seq.num_cached, seq.block_table, "all")
                 for seq, drafts in zip(seqs, proposal.tokens)]
        return draft_tokens, items
    draft_tokens = proposal.device_tokens.to(target.device)  # device to device: no host read
    last = to_device(torch.tensor([seq.last_token for seq in seqs], dtype=torch.long), target.device)
    items = [ForwardItem(torch.cat([last[b:b + 1], draft_tokens[b, :n]]), seq.num_cached, seq.block_table, "all")
             for b, (seq, n) in enumerate(zip(seqs, counts))]
    return draft_tokens, items


def _judge(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], proposal: Proposal,
           draft_tokens: torch.Tensor, counts: list[int]) -> VerifyResult:
    """Rejection sampling of every row's drafts against its processed target distributions."""
    k_max = max(counts, default=0)
    flat = processed_probs(logits, seqs, rows)
    # [B, K+1, V]: row b's positions past its own k_b + 1 repeat its last row (the verifier never reads them);
    # the index is a few ints a row, made on the host in one call
    index, start = [], 0
    for n in rows:
        index.append([start + min(j, n - 1) for j in range(k_max + 1)])
        start += n
    p = flat[to_device(torch.tensor(index, dtype=torch.long).view(len(seqs), k_max + 1), flat.device)]
    draft_probs = proposal.probs[:, :max(k_max, 1)] if proposal.probs is not None else None
    if draft_probs is not None:
        draft_probs = to_device(draft_probs, flat.device)
    return rejection_sample(
        p, draft_tokens[:, :k_max], None if draft_probs is None else draft_probs[:, :k_max],
        torch.tensor(counts), proposal.point_mass,
        [s.generator for s in seqs], torch.tensor([s.params.greedy for s in seqs]))


class SDDecoder(Decoder):
    """SD rounds; each sequence drafts the K its ``schedule`` chooses for the round (up to ``k``; 0: an AR step),
    so sequences of one batch may draft different K within one verification."""
    reports_spec = True

    def __init__(self, target: ModelRunner, proposer: Proposer, k: int, max_model_len: int,
                 schedule: KSchedule | None = None):
        self.target = target
        self.proposer = proposer
        self.k = k
        self.lookahead = k + 1
        self.max_model_len = max_model_len
        self.schedule = schedule if schedule is not None else FixedK(k)

    def decode(self, seqs: list[Sequence]) -> list[list[int]]:
        ks = self.schedule.choose(seqs)  # from rounds verified before this one only
        budgets = [draft_budget(s, min(k, self.k), self.max_model_len) for s, k in zip(seqs, ks)]
        backlog = max((self.proposer.backlog(s) for s, n in zip(seqs, budgets) if n), default=0)
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, budgets, read=False)  # drafts read with the outcome
        t1 = time.perf_counter()
        result = verify_round(self.target, seqs, proposal)
        t2 = time.perf_counter()
        counts = proposal.num_drafts()
        for seq, drafted, accepted in zip(seqs, counts, result.num_accepted):
            self.proposer.commit(seq, drafted, accepted)
            self.schedule.observe(seq, drafted, accepted)
        if backlog <= 1:  # a draft that first caught up on tokens skipped at K = 0 ran a prefill, not K steps
            self.schedule.observe_draft(sum(1 for n in counts if n), max(counts, default=0), t1 - t0)
        self.schedule.observe_verify(len(seqs) + sum(counts), t2 - t1)
        return result.output_tokens

    def prefilling(self, seqs: list[Sequence], ends: list[int]) -> None:
        self.proposer.prefill(seqs, ends)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
        self.schedule.release(seq.seq_id)
