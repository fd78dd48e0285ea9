"""Training data for an EAGLE-3 head: text chunks labelled by the target's own forward pass.

Texts: HumanEval prompts past the first ``EVAL_ITEMS`` (the benchmarks and the held-out report read those),
MT-Bench first turns, and the Python standard library's sources (on every machine). Each chunk of T tokens
runs once through the target (eager, with its taps tapped); an ``Example`` keeps what training reads:
  tokens    [T]         the chunk
  features  [T, A*H_t]  the target's tapped layers' inputs at each position
  top_ids   [T, k]      the target's k likeliest next tokens at each position (its distribution, truncated)
  top_probs [T, k]      their probabilities
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro import datasets
from saguaro.engine.model_runner import ForwardItem, ModelRunner

EVAL_ITEMS = 32  # HumanEval items kept out of training: the front of the set, where evaluation reads


@dataclass
class Example:
    tokens: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor


def training_texts() -> list[str]:
    """HumanEval past the evaluation items, MT-Bench, then the standard library's sources (sorted)."""
    texts: list[str] = []
    for source in (lambda: datasets.humaneval()[EVAL_ITEMS:], datasets.mtbench):
        try:
            texts += source()
        except FileNotFoundError:  # a prompt package not installed: the sources below still serve
            pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts += [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))]
    return texts


def chunk_texts(tokenizer, texts: list[str], seq_len: int, max_tokens: int, skip: int = 0) -> list[list[int]]:
    """Cut the texts into chunks of ``seq_len`` tokens (a text's tail shorter than 8 tokens is dropped) until
    ``max_tokens`` tokens, after skipping the first ``skip`` chunks."""
    chunks: list[list[int]] = []
    total = 0
    for text in texts:
        ids = tokenizer.encode(text)
        for start in range(0, len(ids), seq_len):
            piece = ids[start:start + seq_len]
            if len(piece) < 8:
                continue
            if skip:
                skip -= 1
                continue
            chunks.append(piece)
            total += len(piece)
            if total >= max_tokens:
                return chunks
    return chunks


def label(target: ModelRunner, taps: list[int], chunks: list[list[int]], top_k: int,
          progress=None) -> list[Example]:
    """Run each chunk through the target once; keep its features and top-k next-token distribution."""
    examples = []
    kept: list[torch.Tensor] = []
    target.tap(taps, lambda items, features: kept.append(features))
    for chunk in chunks:
        table: list[int] = []
        target.blocks.reserve(table, len(chunk))
        try:
            logits = target.forward([ForwardItem(chunk, 0, table, "all")])[0]
        finally:
            target.blocks.free(table)
        probs, ids = torch.softmax(logits.float(), -1).topk(top_k, -1)
        # clones made outside inference mode: training differentiates through the features
        examples.append(Example(torch.tensor(chunk), kept.pop().float().cpu().clone(), ids.cpu().clone(),
                                probs.cpu().clone()))
        if progress is not None:
            progress.update(len(chunk))
    return examples
