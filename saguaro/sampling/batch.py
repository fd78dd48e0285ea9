"""Glue between sequences and the row-wise sampling kernels."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from saguaro.sampling.processors import probs_from_logits, sampling_tensors
from saguaro.sampling.sampler import sample

if TYPE_CHECKING:
    from saguaro.engine.sequence import Sequence

INVALID_TOKEN = -1  # what ``sample_next`` gives a row it cannot sample from; the engine fails that request alone


def processed_probs(logits: torch.Tensor, seqs: list["Sequence"], rows_per_seq: int = 1) -> torch.Tensor:
    """Probabilities after each sequence's temperature/top-k/top-p; rows grouped per sequence."""
    params = [s.params for s in seqs for _ in range(rows_per_seq)]
    temperature, top_k, top_p = sampling_tensors(params)
    return probs_from_logits(logits, temperature, top_k, top_p)


def sample_next(logits: torch.Tensor, seqs: list["Sequence"]) -> list[int]:
    """One token per sequence from its logits row, with that sequence's own generator; ``INVALID_TOKEN`` for a
    row whose probabilities are no distribution (NaN or infinite logits)."""
    probs = processed_probs(logits, seqs)
    greedy = torch.tensor([s.params.greedy for s in seqs])
    tokens = sample(probs, [s.generator for s in seqs], greedy)
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # on the device: read with the tokens
    return torch.where(valid, tokens, torch.full_like(tokens, INVALID_TOKEN)).tolist()
