"""lm-evaluation-harness end to end: its ``local-completions`` model against real AR and SSD servers.

The harness scores text the way evaluation clients do: ``echo`` with ``logprobs`` on token-id prompts, a
batch of prompts per request, and it reads back every prompt token's logprob and whether it was the
top token. A multiple-choice task (``acc``) and a rolling-loglikelihood task (perplexity), both written
here with their data (no hub), run against an AR server and an SSD server over the same tiny byte-level
model, the first with the tokenizer's files, the second through the server's tokenizer routes. Every
loglikelihood the harness logs must equal the engine's own prompt logprobs of the same tokens, and the
scores of AR and SSD must be equal.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("lm_eval")  # a dev dependency: absent on the GPU machine

from saguaro import LLM, SamplingParams  # noqa: E402
from tests.serving import running_server  # noqa: E402
from tests.tiny import tiny_model, trained_tokenizer, truncated  # noqa: E402

CHOICE_TASK, ROLLING_TASK = "saguaro_tiny_choice", "saguaro_tiny_rolling"
QUESTIONS = [
    ("def f(x):\n    return", [" x * 2", " hello", " 🌵"], 0),
    ("Hello world,", [" hello saguaro!", " tabs", " café"], 0),
    ("naïve café", [" 日本語", " world", " x"], 1),
    ("    indented", ["    spaces", "aaaa", " return"], 0),
    ("aaaaaaaa", ["aaaa", " doubles", "\t\ttabs"], 2),
]
EOS = "<|endoftext|>"
TEXTS = ["def f(x):\n    return x * 2  # doubles", "Hello world, hello saguaro! naïve café 日本語 🌵🤖"]


def write_tasks(root) -> None:
    """Two task YAMLs over JSONL files in ``root`` (the harness loads them with ``datasets``' json builder)."""
    with open(root / "choice.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(root / "rolling.jsonl", "w") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (root / "choice.yaml").write_text(
        f"task: {CHOICE_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'choice.jsonl'}\n"
        f"  cache_dir: {root / 'cache'}\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    (root / "rolling.yaml").write_text(
        f"task: {ROLLING_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'rolling.jsonl'}\n"
        f"  cache_dir: {root / 'cache'}\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")


def byte_level_model_with_eos():
    """A tiny model with a byte-level BPE tokenizer (any text encodes) and an end-of-text token, as real models
    have: the harness starts a rolling loglikelihood's first window with it."""
    from tokenizers import models, pre_tokenizers
    tok = trained_tokenizer(models.BPE(), pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
                            byte_level=True, special_tokens=[EOS])
    eos = tok.token_to_id(EOS)
    tok.eos_token_ids = [eos]
    return dataclasses.replace(tiny_model(seed=2, vocab=tok.vocab_size, eos=eos), tokenizer=tok)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    target = byte_level_model_with_eos()
    write_tasks(root)
    return target, tokenizer_dir(target, root / "tokenizer"), root


def tokenizer_dir(loaded, directory):
    """The model's tokenizer as the harness loads it (``transformers.AutoTokenizer``): its tokenizer.json, and a
    config naming the generic fast class, so that no model type's own pre-tokenizer replaces the file's."""
    directory.mkdir()
    loaded.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}))
    return directory


def evaluate(url: str, tokenizer: str, root) -> dict:
    """The harness's python API, offline, as a user runs it: local-completions at the server's completions URL,
    two (context, continuation) pairs per request; ``tokenizer`` is its model_args for the tokenizer."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    args = f"model=tiny,base_url={url}/v1/completions,{tokenizer}batch_size=2,max_retries=1"
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[CHOICE_TASK, ROLLING_TASK],
                                   task_manager=TaskManager(include_path=str(root)), log_samples=True)


def loglikelihoods(results: dict) -> dict:
    """(task, doc, request index) -> (context, continuation, loglikelihood) from the logged samples; a rolling
    request's context is None (the harness puts the end-of-text token before the text)."""
    out = {}
    for task, samples in results["samples"].items():
        for s in samples:
            for i, (args, resp) in enumerate(zip(s["arguments"], s["resps"])):
                if len(args) == 1:  # rolling: (text,) -> [sum over its windows]
                    out[task, s["doc_id"], i] = (None, args[0], float(resp[0]))
                else:  # (context, continuation) -> [(loglikelihood, is_greedy)]
                    out[task, s["doc_id"], i] = (args[0], args[1], float(resp[0][0]))
    return out


def engine_scores(target, pairs) -> list[float]:
    """The engine's own score of each (context, continuation): the sum of the continuation's prompt logprobs,
    tokenized as the harness tokenizes (the whole text, then the context's tokens are the first ones)."""
    tok = target.tokenizer
    prompts, starts = [], []
    for context, continuation in pairs:
        if context is None:  # one window: end-of-text, then every token of the text is scored
            prompts.append([tok.eos_token_id] + tok.encode(continuation, add_special_tokens=False))
            starts.append(1)
        else:
            prompts.append(tok.encode(context + continuation, add_special_tokens=False))
            starts.append(len(tok.encode(context, add_special_tokens=False)))
    with LLM(target, block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=1))
    return [sum(e.logprob for e in out.prompt_logprobs[s:]) for out, s in zip(outs, starts)]


def test_lm_eval_scores_equal_under_ar_and_ssd(setup, monkeypatch):
    """AR with the tokenizer's files given to the harness; SSD with none, so the harness finds the server's
    tokenizer routes by itself (its default, ``tokenizer_backend=auto``; without them it would load a tokenizer
    named "tiny" from the hub, which fails offline): both count the same tokens."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, tokenizer, root = setup
    draft = truncated(target, 1)
    runs = {}
    for mode, llm, tokenizer_args in (
            ("ar", LLM(target, block_size=4), f"tokenizer={tokenizer},tokenizer_backend=huggingface,"),
            ("ssd", LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=3, fan_out=[2, 2, 2, 4],
                        block_size=4, worker_timeout_s=60), "")):
        with llm, running_server(llm) as served:
            runs[mode] = evaluate(served.url, tokenizer_args, root)
    ar, ssd = (loglikelihoods(runs[m]) for m in ("ar", "ssd"))
    assert len(ar) == sum(len(c) for _, c, _ in QUESTIONS) + len(TEXTS) and ar.keys() == ssd.keys()
    keys = sorted(ar)
    expected = engine_scores(target, [ar[k][:2] for k in keys])
    for key, want in zip(keys, expected):
        assert ar[key][2] == pytest.approx(want, abs=1e-3), key
        assert ssd[key][2] == pytest.approx(ar[key][2], abs=1e-4), key
    scores = {m: runs[m]["results"] for m in runs}
    assert scores["ar"][CHOICE_TASK]["acc,none"] == scores["ssd"][CHOICE_TASK]["acc,none"]
    assert math.isfinite(scores["ar"][ROLLING_TASK]["word_perplexity,none"])
    assert scores["ssd"][ROLLING_TASK]["word_perplexity,none"] == pytest.approx(
        scores["ar"][ROLLING_TASK]["word_perplexity,none"], rel=1e-5)
