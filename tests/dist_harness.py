"""Engine-level distribution checks (not a test file).

Runs N independent seeded requests through the real engine and compares the empirical
joint law of chosen output positions with the target's exact law, computed from the
target model alone by enumerating every continuation (the AR definition of the output
distribution). Threshold, from ``tests/stats.py``: with n samples over m outcomes of
positive probability, TV <= 0.5*sqrt((m-1)/n) + sqrt(ln(1/delta)/(2n)) fails a correct
engine with probability below delta = 1e-6. For n = 50,000 this is about 0.047 at
m = 256 (V = 16, two tokens) and 0.030 at m = 64 (V = 8, two tokens).
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from saguaro import LLM, SamplingParams
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.sampling.processors import probs_from_logits, sampling_tensors
from tests.stats import empirical, tv_distance, tv_threshold

NUM_SAMPLES = 50_000
PROMPT = [3, 7, 1]


@torch.no_grad()
def exact_law(loaded, params: SamplingParams, n: int, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(t_1..t_n | prompt) under the target alone, as a tensor of shape [V] * n."""
    vocab = loaded.config.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=n - 1))
    length = len(prompt) + n - 1
    cache = KVCache(loaded.config, len(prefixes) * length, 1, torch.float32)
    ids = [t for pre in prefixes for t in prompt + list(pre)]
    slots = [list(range(i * length, (i + 1) * length)) for i in range(len(prefixes))]
    meta = build_metadata(slots, [length] * len(prefixes))
    hidden = loaded.model(torch.tensor(ids), torch.arange(length).repeat(len(prefixes)), cache, meta)
    hidden = hidden.view(len(prefixes), length, -1)[:, len(prompt) - 1:]  # rows predicting t_1..t_n
    logits = loaded.model.logits(hidden.reshape(-1, hidden.shape[-1]))
    probs = probs_from_logits(logits, *sampling_tensors([params] * logits.shape[0])).double()
    probs = probs.view(len(prefixes), n, vocab)
    law = torch.ones([vocab] * n, dtype=torch.float64)
    for j in range(n):
        # factor j: P(t_{j+1} | prompt, t_1..t_j), read off any prefix that starts with t_1..t_j
        index = [slice(None)] * j + [0] * (n - 1 - j)
        factor = probs[:, j].view([vocab] * (n - 1) + [vocab])[tuple(index)]
        law = law * factor.view([vocab] * (j + 1) + [1] * (n - 1 - j))
    return law


def sample_positions(llm: LLM, params: SamplingParams, positions: list[int], n: int = NUM_SAMPLES) -> torch.Tensor:
    """Outcome index of output tokens at ``positions`` (0-based) for n seeded requests.

    Requests run K tokens past the last position, so that speculation is never cut short
    by ``max_tokens`` before the positions we look at (the engine drafts no more than a
    request can still use).
    """
    vocab = llm.target.config.vocab_size
    extra = llm.config.num_speculative_tokens if llm.config.mode != "ar" else 0
    base = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                max_tokens=max(positions) + 1 + extra, ignore_eos=True)
    outs = llm.generate([PROMPT] * n, [SamplingParams(seed=i, **base) for i in range(n)])
    return outcome_index(outs, positions, vocab)


def measure(llm: LLM, target, params: SamplingParams, positions: list[int], n: int = NUM_SAMPLES
            ) -> tuple[float, float]:
    """(TV distance between engine samples and the exact law at ``positions``, threshold)."""
    p = law_at(target, params, positions)
    samples = sample_positions(llm, params, positions, n)
    return tv_distance(empirical(samples, p.numel()), p), tv_threshold(n, int((p > 0).sum()))


def law_at(target, params: SamplingParams, positions: list[int], prompt: list[int] = PROMPT) -> torch.Tensor:
    """The exact AR law of the output tokens at ``positions``, flattened over outcome indices."""
    law = exact_law(target, params, max(positions) + 1, prompt)
    drop = tuple(d for d in range(law.dim()) if d not in positions)
    return law.sum(dim=drop).reshape(-1) if drop else law.reshape(-1)


def outcome_index(outs, positions: list[int], vocab: int) -> torch.Tensor:
    index = torch.zeros(len(outs), dtype=torch.long)
    for j in positions:
        index = index * vocab + torch.tensor([o.token_ids[j] for o in outs])
    return index


def measure_mixed(llm: LLM, target, classes: list[tuple[SamplingParams, list[int]]], positions: list[int], n: int
                  ) -> list[tuple[float, float] | bool]:
    """One batch of ``n`` requests cycling through ``classes`` of (sampling settings, prompt): request i
    belongs to class i % len(classes), as a server sees mixed greedy and sampled traffic. Per class: for a
    sampled class, (TV between its requests' outputs at ``positions`` and its own exact law, threshold); for
    a greedy class, whether every one of its requests equals the greedy AR output for its prompt.

    Classes have their own prompts so that the draft distributions of neighbouring rows differ, as they do
    in real traffic: a row verified against a neighbour's distributions then shows in the law."""
    vocab = llm.target.config.vocab_size
    extra = llm.config.num_speculative_tokens if llm.config.mode != "ar" else 0
    length = max(positions) + 1 + extra
    prompts, params = [], []
    for i in range(n):
        c, prompt = classes[i % len(classes)]
        prompts.append(prompt)
        # a class's own max_tokens applies when it is shorter (a smaller draft budget near the end)
        params.append(replace(c, max_tokens=min(c.max_tokens, length), ignore_eos=True,
                              seed=None if c.greedy else i))
    outs = llm.generate(prompts, params)
    results: list[tuple[float, float] | bool] = []
    for c_index, (c, prompt) in enumerate(classes):
        mine = outs[c_index::len(classes)]
        if c.greedy:
            reference = greedy_reference(target, prompt, min(c.max_tokens, length))
            results.append(all(o.token_ids == reference for o in mine))
            continue
        p = law_at(target, c, positions, prompt)
        samples = outcome_index(mine, positions, vocab)
        results.append((tv_distance(empirical(samples, p.numel()), p), tv_threshold(len(mine), int((p > 0).sum()))))
    return results


def greedy_reference(target, prompt: list[int], length: int) -> list[int]:
    with LLM(target, block_size=4) as llm:
        return llm.generate([prompt], SamplingParams(max_tokens=length, ignore_eos=True))[0].token_ids


def in_process(llm: LLM) -> LLM:
    """Serve ``llm``'s SSD rounds synchronously in this process, so that every build completes before the next
    round. Beside the target, a speculator that finds the next request already waiting skips its build (the
    round then misses), so hit rates there depend on how the OS schedules the two; and a monkeypatch made here
    reaches the speculator's code only in this process."""
    from saguaro.ssd.in_process import InProcessLink
    worker = llm.engine.decoder.link
    worker.stop()
    llm.engine.decoder.link = InProcessLink(llm.draft, worker.opts)
    return llm
