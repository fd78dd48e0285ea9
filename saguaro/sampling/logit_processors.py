"""Per-request logit processors: penalties, logit bias and min_tokens, on the target's logits.

They change the distribution a request samples from, so speculative decoding stays exact only if
the verifier applies them at every position it scores exactly as plain decoding would there. A
verification pass scores ``k + 1`` positions of one sequence at once; row ``j`` follows the
sequence's tokens and the drafts ``d_1 .. d_j``, so its counts are the output's counts plus those
drafts (as if accepted), and none of the drafts after it. When the round keeps the prefix up to
``j``, that is exactly the history AR would have had there; the rows after a rejection are never
read. The draft needs none of this: the verifier judges each draft against the ``q`` it was
sampled from.

Conventions follow vLLM (and OpenAI for the first two):

* ``frequency_penalty`` subtracts ``penalty * count`` and ``presence_penalty`` subtracts ``penalty``
  once, for the tokens of the *output* so far.
* ``repetition_penalty`` (the CTRL rule, as transformers and vLLM apply it) divides a positive
  logit by the penalty and multiplies a negative one, for tokens of the prompt *or* the output.
* ``logit_bias`` adds its value to the token's logit.
* ``min_tokens``: while the output is shorter, EOS (unless ``ignore_eos``) and ``stop_token_ids``
  get logit -inf.

Order: repetition, frequency and presence, bias, then the min_tokens mask; temperature, top-k and
top-p come after all of them (``saguaro.sampling.processors``). Only the rows of requests that set
a processor are touched; a batch without any pays nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from saguaro.device import to_device
from saguaro.sampling.grammar import apply_grammar_masks

if TYPE_CHECKING:
    from saguaro.engine.sequence import Sequence


def apply_logit_processors(logits: torch.Tensor, seqs: list["Sequence"], rows: list[int] | None = None,
                           drafts: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` [R, V] after each row's processors, then its grammar mask (``saguaro.sampling.grammar``), as
    float32 (the input itself when no row has any).

    Args:
        logits: rows grouped per sequence, ``rows[b]`` of them for ``seqs[b]`` (one each when None).
        seqs: the sequences; row ``j`` of sequence ``b`` scores position ``len(seqs[b]) + j``.
        rows: rows per sequence.
        drafts: [B, W] drafted tokens (on any device; padding beyond a row's drafts is never read):
            row ``j`` of sequence ``b`` counts ``drafts[b, :j]`` as output.
    """
    rows = [1] * len(seqs) if rows is None else rows
    return apply_grammar_masks(_penalized_rows(logits, seqs, rows, drafts), seqs, rows, drafts)


def _penalized_rows(logits: torch.Tensor, seqs: list["Sequence"], rows: list[int],
                    drafts: torch.Tensor | None) -> torch.Tensor:
    active = [b for b, s in enumerate(seqs) if s.params.has_processors]
    if not active:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    # the active sequences' rows, in order, and per such row its sequence (index into ``active``) and depth j
    row_index = [starts[b] + j for b in active for j in range(rows[b])]
    owner = [a for a, b in enumerate(active) for _ in range(rows[b])]
    depth = [j for b in active for j in range(rows[b])]
    index = to_device(torch.tensor(row_index, dtype=torch.long), device)
    counts = _output_counts([seqs[b] for b in active], owner, vocab, device)
    if drafts is not None and drafts.shape[1] > 0:
        _add_drafts(counts, drafts, active, owner, depth)
    x = _penalized(logits[index].float(), counts, [seqs[b] for b in active], owner, depth)
    out = logits.float().clone()
    out[index] = x
    return out


def _output_counts(seqs: list["Sequence"], owner: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, V] float32: each row's sequence's output token counts (drafts not yet added)."""
    base = torch.zeros(len(seqs), vocab, dtype=torch.float32)
    for a, seq in enumerate(seqs):
        if seq.output_ids:
            base[a] = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
    return to_device(base, device)[to_device(torch.tensor(owner, dtype=torch.long), device)]


def _add_drafts(counts: torch.Tensor, drafts: torch.Tensor, active: list[int], owner: list[int],
                depth: list[int]) -> None:
    """Row ``j`` of a sequence counts its drafts ``d_1 .. d_j``: one (row, draft) pair per earlier draft."""
    pairs = [(r, active[owner[r]], i) for r in range(len(owner)) for i in range(depth[r])]
    if not pairs:
        return
    device = counts.device
    row, seq_row, col = (to_device(torch.tensor(c, dtype=torch.long), device) for c in zip(*pairs))
    tokens = to_device(drafts, device).to(torch.long)[seq_row, col]
    counts.index_put_((row, tokens), torch.ones(len(pairs), device=device), accumulate=True)


def _row_values(values: list[float], owner: list[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor([values[a] for a in owner], dtype=torch.float32), device).unsqueeze(1)


def _penalized(x: torch.Tensor, counts: torch.Tensor, seqs: list["Sequence"], owner: list[int],
               depth: list[int]) -> torch.Tensor:
    """The processors on rows ``x`` [rows, V] (see the module docstring for the order)."""
    device, vocab = x.device, x.shape[-1]
    params = [s.params for s in seqs]
    if any(p.repetition_penalty != 1 for p in params):
        in_prompt = torch.zeros(len(seqs), vocab, dtype=torch.bool)
        for a, seq in enumerate(seqs):
            in_prompt[a, torch.tensor(seq.prompt_ids, dtype=torch.long)] = True
        seen = to_device(in_prompt, device)[to_device(torch.tensor(owner, dtype=torch.long), device)] | (counts > 0)
        rep = _row_values([p.repetition_penalty for p in params], owner, device)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        x = x - _row_values([p.frequency_penalty for p in params], owner, device) * counts
        x = x - _row_values([p.presence_penalty for p in params], owner, device) * (counts > 0).float()
    if any(p.logit_bias for p in params):
        bias = torch.zeros(len(seqs), vocab, dtype=torch.float32)
        for a, p in enumerate(params):
            if p.logit_bias:
                bias[a, torch.tensor(list(p.logit_bias), dtype=torch.long)] = torch.tensor(list(p.logit_bias.values()))
        x = x + to_device(bias, device)[to_device(torch.tensor(owner, dtype=torch.long), device)]
    banned = [(r, t) for r, a in enumerate(owner)
              if len(seqs[a].output_ids) + depth[r] < params[a].min_tokens for t in seqs[a].end_ids if t < vocab]
    if banned:
        row, token = (to_device(torch.tensor(c, dtype=torch.long), device) for c in zip(*banned))
        x = x.index_put((row, token), torch.tensor(float("-inf"), device=device))
    return x
