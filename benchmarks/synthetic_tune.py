"""Measure a synthetic pair (``benchmarks/synthetic.py``): greedy acceptance, tokens per round, acceptance by
draft position, SSD's cache hits, for a few recipes.

Under greedy decoding an SD round accepts the draft's guesses while they equal the target's own next tokens.
So the target's greedy text and the draft's top guesses along it (one teacher-forced pass per draft) give
every round of greedy SD at any K, for any number of drafts, without running SD. Had every SSD build
finished, SSD's rounds would be SD's, and its cache hits follow from the same guesses (``p_hit`` below).
``--ssd`` also runs SSD through the engine, where builds cut short by the next request (their timing is
the device's) change the rounds.

    python -m benchmarks.synthetic --shape qwen2.5-1.5b --tune                      # the default recipe
    python -m benchmarks.synthetic --shape qwen2.5-1.5b --tune --noise 0.08,0.1,0.13 --layers 1,6,12 --ssd
    python -m benchmarks.synthetic --shape tiny --tune --max-tokens 32                # smoke
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import float_list, fmt, int_list, log, table
from benchmarks.synthetic import DEFAULT_RECIPES, SHAPES, layer_skip_draft, prompts, synthetic_pair
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.outputs import SpeculationMetrics
from saguaro.loading import LoadedModel


def _runner(model: LoadedModel, sequences: int, longest: int) -> tuple[ModelRunner, list[list[int]]]:
    device = str(next(model.model.parameters()).device)
    runner = ModelRunner(model.model, sequences * (longest // 16 + 2), 16, device, enforce_eager=False,
                         max_seq_len=longest)
    tables: list[list[int]] = [[] for _ in range(sequences)]
    for block_table in tables:
        runner.blocks.reserve(block_table, longest)
    return runner, tables


@torch.inference_mode()
def greedy_texts(model: LoadedModel, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """``model``'s greedy continuations of ``prompt_ids`` (``n`` tokens each), decoded together."""
    runner, tables = _runner(model, len(prompt_ids), max(map(len, prompt_ids)) + n)
    logits = runner.forward([ForwardItem(p, 0, t) for p, t in zip(prompt_ids, tables)])
    texts: list[list[int]] = [[] for _ in prompt_ids]
    for step in range(n):
        for text, rows in zip(texts, logits):
            text.append(int(rows[-1].argmax()))
        if step + 1 < n:
            logits = runner.forward([ForwardItem(text[-1:], len(p) + step, t)
                                     for p, text, t in zip(prompt_ids, texts, tables)])
    runner.close()
    return texts


@torch.inference_mode()
def top_guesses(model: LoadedModel, prompt_ids: list[list[int]], texts: list[list[int]], top: int = 3,
                ) -> list[torch.Tensor]:
    """Per text, [len(text), top]: ``model``'s likeliest next tokens at each token, given all before it."""
    runner, tables = _runner(model, len(prompt_ids), max(len(p) + len(t) for p, t in zip(prompt_ids, texts)))
    runner.forward([ForwardItem(p[:-1], 0, t, "none") for p, t in zip(prompt_ids, tables)])
    logits = runner.forward([ForwardItem(p[-1:] + text[:-1], len(p) - 1, t, "all")
                             for p, text, t in zip(prompt_ids, texts, tables)])
    runner.close()
    return [rows.topk(top, dim=-1).indices.cpu() for rows in logits]


@dataclass
class GreedyAgreement:
    """Greedy SD of a draft against a target over texts, as the engine would count it, and SSD's cache hits had
    every build finished (SSD's rounds are then SD's)."""
    acceptance: float  # accepted / drafted
    tokens_per_round: float
    by_position: list[float]  # accepted / drafted at draft position j = 1..K of a round
    runner_up: float  # where the draft's guess was wrong: how often the target's token was its second guess
    p_hit: float  # rounds whose outcome SSD had cached, with fan-out ``hit_fan_out``
    distinct: float  # distinct tokens per text, mean


def greedy_agreement(texts: list[list[int]], guesses: list[torch.Tensor], k: int, fan_out: list[int] | None = None,
                     ) -> GreedyAgreement:
    """SD's greedy rounds over ``texts`` given the draft's ``guesses`` (``top_guesses``), counted as the engine
    counts them (a round near the end drafts only as many tokens as fit), and SSD's hits: the cache holds, for each
    depth k, the draft's top ``fan_out[k]`` guesses other than its drafted token (default [1] * K + [2])."""
    fan_out = fan_out or [1] * k + [2]
    drafted, accepted, rounds, hits = [0] * k, [0] * k, 0, 0
    wrong = second = 0
    for text, guess in zip(texts, guesses):
        match = [int(g) == t for g, t in zip(guess[:, 0], text)]
        wrong += match.count(False)
        second += sum(int(g[1]) == t for g, t, m in zip(guess, text, match) if not m)
        i = 1  # the prefill emits text[0]; rounds start after it
        while i < len(text):
            tries = min(k, len(text) - i - 1)  # the engine's budget: the round's own token must fit too
            run = next((j for j in range(tries) if not match[i + j]), tries)
            for j in range(tries):
                drafted[j] += 1
                accepted[j] += j < run
            end = i + run  # the target's own token: a correction, or the bonus after all K
            cached = guess[end, 1:] if run < tries else guess[end]  # a rejected guess is no bonus guess
            hits += text[end] in cached[:fan_out[run]].tolist()
            rounds, i = rounds + 1, end + 1
    return GreedyAgreement(sum(accepted) / sum(drafted), (sum(accepted) + rounds) / rounds,
                           [a / d for a, d in zip(accepted, drafted)], second / wrong if wrong else float("nan"),
                           hits / rounds, sum(len(set(t)) for t in texts) / len(texts))


def engine_metrics(target: LoadedModel, draft: LoadedModel, prompt_ids: list[list[int]], max_tokens: int,
                   **options: Any) -> SpeculationMetrics:
    """Speculation metrics of greedy requests through ``LLM`` (mode, K, fan-out... in ``options``), on the
    target's device and dtype."""
    from saguaro import LLM, SamplingParams
    weight = next(target.model.parameters())
    options = {"device": str(weight.device), "dtype": str(weight.dtype).removeprefix("torch."), **options}
    longest = max(map(len, prompt_ids)) + max_tokens + 16
    with LLM(target=target, draft=draft, max_model_len=longest, kv_cache_tokens=len(prompt_ids) * longest + 1024,
             **options) as llm:
        outs = llm.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return llm.spec_metrics(outs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    p.add_argument("--tune", action="store_true", help="measure (else: print the shape's recipe)")
    p.add_argument("--noise", type=float_list, help="candidates (default: the recipe's)")
    p.add_argument("--layers", type=int_list, help="draft layers L, candidates (default: the recipe's)")
    p.add_argument("--rivals", type=int, help="override the recipe's")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fan-out", type=int_list, help="SSD's F_0..F_K (default [1] * K + [2])")
    p.add_argument("--branch-steps", type=int, default=2, help="SSD's tapered tree (with --ssd)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--ssd", action="store_true", help="also run SSD through the engine (slow on a CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=1, help="of the prompts")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    recipe = DEFAULT_RECIPES.get(args.shape, DEFAULT_RECIPES["qwen2.5-1.5b"])
    if not args.tune:
        print(f"{args.shape}: {recipe}")
        return
    k = args.k
    fan_out = args.fan_out or [1] * k + [2]
    overrides: dict[str, Any] = {} if args.rivals is None else {"rivals": args.rivals}
    rows = []
    for noise in args.noise or [recipe.noise]:
        log(f"building {args.shape} with noise {noise}")
        target, _, info = synthetic_pair(args.shape, args.device, noise=noise, **overrides)
        ids = prompts(target.config.vocab_size, args.prompts, args.prompt_len, seed=args.seed)
        log(f"greedy texts: {args.prompts} x {args.max_tokens} tokens")
        texts = greedy_texts(target, ids, args.max_tokens)
        inside = set(info["subset"].tolist())
        outside = sum(t not in inside for text in texts for t in text)
        for layers in args.layers or [recipe.draft_layers]:
            draft = layer_skip_draft(target, layers)
            a = greedy_agreement(texts, top_guesses(draft, ids, texts, max(fan_out) + 1), k, fan_out)
            row = [noise, layers, fmt(info["residual_scale"], ".4f"), fmt(share(draft, target)),
                   fmt(a.acceptance, ".3f"), fmt(a.tokens_per_round), " ".join(fmt(b) for b in a.by_position),
                   fmt(a.runner_up), fmt(a.p_hit), fmt(a.distinct, ".0f"), outside]
            if args.ssd:
                log(f"SSD through the engine, L = {layers}")
                m = engine_metrics(target, draft, ids, args.max_tokens, mode="ssd", num_speculative_tokens=k,
                                   fan_out=fan_out, branch_steps=args.branch_steps)
                row += [fmt(m.acceptance_rate, ".3f"), fmt(m.tokens_per_round), fmt(m.cache_hit_rate)]
            rows.append(row)
    print(f"# {args.shape}: random weights of real shapes; synthetic layer-skip draft\n\n"
          f"{args.prompts} random prompts of {args.prompt_len} tokens, {args.max_tokens} greedy tokens each; K = {k}; "
          f"SSD fan-out {fan_out}; recipe {recipe} (noise and L as below).\n")
    headers = ["noise", "L", "residual scale", "draft bytes", "accept", "tok/rnd", "accept by position",
               "runner-up", "p_hit", "distinct", "outside S"]
    if args.ssd:
        headers += ["SSD accept", "SSD tok/rnd", "SSD p_hit"]
    print(table(headers, rows))


def share(draft: LoadedModel, target: LoadedModel) -> float:
    from benchmarks.synthetic import weight_bytes
    return weight_bytes(draft.model) / weight_bytes(target.model)


if __name__ == "__main__":
    main()
