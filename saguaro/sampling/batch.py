"""Glue between sequences and the row-wise sampling kernels."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from saguaro.sampling.logit_processors import apply_logit_processors
from saguaro.sampling.logprobs import record_logprobs
from saguaro.sampling.processors import probs_from_logits, sampling_tensors
from saguaro.sampling.sampler import sample

if TYPE_CHECKING:
    from saguaro.engine.sequence import Sequence

INVALID_TOKEN = -1  # what ``sample_next`` gives a row it cannot sample from; the engine fails that request alone


def processed_probs(logits: torch.Tensor, seqs: list["Sequence"], rows_per_seq: int | list[int] = 1
                    ) -> torch.Tensor:
    """Probabilities after each sequence's temperature/top-k/top-p; rows grouped per sequence (``rows_per_seq``
    each, or ``rows_per_seq[b]`` for ``seqs[b]``). The target's p takes its logit processors first
    (``apply_logit_processors``)."""
    counts = rows_per_seq if isinstance(rows_per_seq, list) else [rows_per_seq] * len(seqs)
    params = [s.params for s, n in zip(seqs, counts) for _ in range(n)]
    temperature, top_k, top_p = sampling_tensors(params)
    return probs_from_logits(logits, temperature, top_k, top_p)


def sample_next(logits: torch.Tensor, seqs: list["Sequence"]) -> list[int]:
    """One token per sequence from its logits row, with that sequence's own generator; ``INVALID_TOKEN`` for a
    row whose probabilities are no distribution (NaN or infinite logits)."""
    processed = apply_logit_processors(logits, seqs)
    probs = processed_probs(processed, seqs)
    greedy = [s.params.greedy for s in seqs]
    tokens = sample(probs, [s.generator for s in seqs], torch.tensor(greedy))
    if all(greedy):  # a greedy row's probabilities are a one-hot: always a distribution
        out = tokens.tolist()
    else:
        valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # on the device: read with the tokens
        out = torch.where(valid, tokens, torch.full_like(tokens, INVALID_TOKEN)).tolist()
    record_logprobs(processed, seqs, [1] * len(seqs), [[t] if t != INVALID_TOKEN else [] for t in out])
    return out
