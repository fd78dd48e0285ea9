"""Log-probabilities of the tokens a request emits (and of its prompt's, for echo), with the top N.

They are the target's, after the request's logit processors and before temperature, top-k and top-p
(as OpenAI's and vLLM's: a greedy request still reports the model's distribution). A token accepted
from a draft takes its row from the verification pass that scored it (that row follows exactly the
drafts before it), and the bonus token the row after them, so logprobs cost no extra pass: only a
log-softmax and a top-N over the rows of the requests that ask for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from saguaro.device import to_device

if TYPE_CHECKING:
    from saguaro.engine.sequence import Sequence


@dataclass
class TokenLogprob:
    """One position: the token there, its log-probability, and the ``n`` likeliest tokens (most likely first)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


def wants_logprobs(seq: "Sequence") -> bool:
    return seq.params.logprobs is not None


def record_logprobs(logits: torch.Tensor, seqs: list["Sequence"], rows: list[int], emitted: list[list[int]]
                    ) -> None:
    """Set ``seq.pending_logprobs`` (one ``TokenLogprob`` per token of ``emitted[b]``) for every sequence that asks.

    Args:
        logits: [R, V] processed target logits, ``rows[b]`` rows for ``seqs[b]``; its row ``j`` scored the
            sequence's ``j``-th emitted token this round.
        emitted: the tokens each sequence gained this round (its first ``len(emitted[b])`` rows).
    """
    wanted = [b for b, s in enumerate(seqs) if wants_logprobs(s) and emitted[b]]
    if not wanted:
        return
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    index = [starts[b] + j for b in wanted for j in range(len(emitted[b]))]
    tokens = [t for b in wanted for t in emitted[b]]
    width = max(seqs[b].params.logprobs for b in wanted)
    entries = iter(token_logprobs(logits[to_device(torch.tensor(index), logits.device)], tokens, width))
    for b in wanted:
        n = seqs[b].params.logprobs
        seqs[b].pending_logprobs = [_cut(next(entries), n) for _ in emitted[b]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], width: int) -> list[TokenLogprob]:
    """Per row of ``logits`` [N, V]: ``tokens[i]``'s log-softmax and the row's ``width`` likeliest tokens.
    One read from the device for all rows."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, to_device(torch.tensor(tokens, dtype=torch.long), logp.device).unsqueeze(1))
    top = torch.topk(logp, min(width, logp.shape[-1]), dim=-1) if width else None
    parts = [chosen.squeeze(1)] + ([top.values, top.indices.to(logp.dtype)] if top is not None else [])
    table = torch.cat([p.reshape(len(tokens), -1) for p in parts], dim=1).cpu()
    out = []
    for t, row in zip(tokens, table.tolist()):
        values, ids = row[1:1 + width], row[1 + width:]
        out.append(TokenLogprob(t, row[0], [(int(i), v) for i, v in zip(ids, values)]))
    return out


def _cut(entry: TokenLogprob, n: int) -> TokenLogprob:
    return entry if len(entry.top) <= n else TokenLogprob(entry.token, entry.logprob, entry.top[:n])


def record_prompt_logprobs(seq: "Sequence", start: int, logits: torch.Tensor) -> None:
    """Score the prompt tokens a prefill chunk's rows predict: ``logits`` [n, V] are the raw target's rows at
    positions ``start .. start + n - 1``, and row ``i`` predicts prompt token ``start + i + 1`` (the last row of
    the last chunk predicts the first output token instead, which the sampler scores)."""
    if start == 0:
        seq.prompt_logprobs = [None]
    tokens = seq.prompt_ids[start + 1:start + 1 + logits.shape[0]]
    if tokens:
        seq.prompt_logprobs += token_logprobs(logits[:len(tokens)], tokens, seq.params.prompt_logprobs)
