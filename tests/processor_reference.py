"""A plain, token-by-token statement of the logit processors (not a test file).

The engine applies them vectorised over a verification pass's rows; these loops state the same rules
one token at a time, so the tests compare the engine against a second, independent reading.
"""
from __future__ import annotations

import itertools
from collections import Counter

import torch

from saguaro import SamplingParams
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.sampling.processors import probs_from_logits, sampling_tensors


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                     end_ids: list[int]) -> torch.Tensor:
    """One row's logits after the processors, for the history ``prompt + output``."""
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    for t, b in params.logit_bias.items():
        x[t] += b
    if len(output) < params.min_tokens:
        for t in end_ids:
            x[t] = float("-inf")
    return x


@torch.no_grad()
def prefix_logits(loaded, prefixes: list[list[int]]) -> torch.Tensor:
    """[P, L, V]: the model's logits at every position of each (equal-length) token list, in one pass."""
    length = len(prefixes[0])
    cache = KVCache(loaded.config, len(prefixes) * length, 1, torch.float32)
    slots = [list(range(i * length, (i + 1) * length)) for i in range(len(prefixes))]
    meta = build_metadata(slots, [length] * len(prefixes))
    ids = torch.tensor([t for p in prefixes for t in p])
    hidden = loaded.model(ids, torch.arange(length).repeat(len(prefixes)), cache, meta)
    return loaded.model.logits(hidden).view(len(prefixes), length, -1)


def reference_greedy(loaded, prompt: list[int], params: SamplingParams, n: int, end_ids: list[int] = ()
                     ) -> list[int]:
    """Greedy decoding with the processors, one full forward pass per token."""
    out: list[int] = []
    for _ in range(n):
        row = prefix_logits(loaded, [prompt + out])[0, -1]
        token = int(reference_logits(row, prompt, out, params, list(end_ids)).argmax())
        out.append(token)
        if token in end_ids and len(out) >= params.min_tokens:
            break
    return out


@torch.no_grad()
def processed_law(loaded, params: SamplingParams, prompt: list[int], n: int) -> torch.Tensor:
    """P(t_1..t_n | prompt) with the processors, as a [V] * n tensor, by enumerating every continuation."""
    vocab = loaded.config.vocab_size
    prefixes = [list(p) for p in itertools.product(range(vocab), repeat=n - 1)]
    logits = prefix_logits(loaded, [prompt + p for p in prefixes])[:, len(prompt) - 1:]  # rows for t_1..t_n
    x = torch.stack([reference_logits(rows[j], prompt, p[:j], params, [])
                     for p, rows in zip(prefixes, logits) for j in range(n)]).float()
    probs = probs_from_logits(x, *sampling_tensors([params] * len(x))).double().view(len(prefixes), n, vocab)
    law = torch.ones([vocab] * n, dtype=torch.float64)
    for j in range(n):  # factor j: P(t_{j+1} | prompt, t_1..t_j), read off any prefix that starts with t_1..t_j
        index = [slice(None)] * j + [0] * (n - 1 - j)
        factor = probs[:, j].reshape([vocab] * (n - 1) + [vocab])[tuple(index)]
        law = law * factor.reshape([vocab] * (j + 1) + [1] * (n - 1 - j))
    return law
