"""Tiny random models for fast engine tests (not a test file).

A word-level tokenizer over tokens "t0".."t{V-1}" plus the real ``Tokenizer`` wrapper,
and transformers-config-shaped ``ModelConfig``s, so the engine runs exactly as it does
on real checkpoints, only smaller.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from saguaro.loading import LoadedModel
from saguaro.loading.tokenizer import Tokenizer, numbered_tokenizer
from saguaro.models.model_config import ModelConfig
from saguaro.models.transformer import CausalLM


def tiny_tokenizer(vocab: int, eos: int | None = None) -> Tokenizer:
    return numbered_tokenizer(vocab, eos)


def tiny_model(seed: int = 0, vocab: int = 64, layers: int = 2, hidden: int = 64, arch: str = "qwen2",
               eos: int | None = None, name: str = "tiny", sharpness: float = 1.0) -> LoadedModel:
    """A random model; ``sharpness`` scales the output head (peakier next-token distributions)."""
    cfg = ModelConfig(arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=512, attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                      eos_token_ids=[eos] if eos is not None else [])
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
        for m in model.modules():
            if hasattr(m, "eps") and hasattr(m, "weight"):
                m.weight.fill_(1.0)
        model.lm_head.weight.mul_(sharpness)
    model.eval().requires_grad_(False)
    return LoadedModel(name, cfg, model, tiny_tokenizer(vocab, eos), Path("."), Path("."), True)


BPE_CORPUS = ["def f(x):\n    return x * 2  # doubles", "Hello world, hello saguaro!", "naïve café 日本語 🌵🤖",
              "    indented    spaces\t\ttabs\n\n\n", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
              "\uac01" * 80, "\u00e9" * 80]  # composed characters, so that NFC tokenizers learn long runs of them


def trained_tokenizer(model, normalizer=None, pre_tokenizer=None, byte_level: bool = False, vocab_size: int = 400,
                      **trainer) -> Tokenizer:
    """A BPE (or other) tokenizer trained on a few lines: real tokenizer machinery at a tiny size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, pre_tokenizers, trainers
    backend = HFTokenizer(model)
    backend.normalizer, backend.pre_tokenizer = normalizer, pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    backend.train_from_iterator(BPE_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False, **trainer))
    if byte_level:
        backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def byte_level_bpe() -> Tokenizer:
    """A small GPT-2-style tokenizer (what SmolLM2 and Qwen use): byte-level BPE."""
    from tokenizers import models, pre_tokenizers
    return trained_tokenizer(models.BPE(), pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
                             byte_level=True)


def byte_level_model(seed: int = 0) -> LoadedModel:
    """``tiny_model`` with a byte-level BPE tokenizer (any text encodes) in place of the numbered words."""
    tokenizer = byte_level_bpe()
    return dataclasses.replace(tiny_model(seed=seed, vocab=tokenizer.vocab_size), tokenizer=tokenizer)


def truncated(loaded: LoadedModel, layers: int, name: str = "tiny-draft") -> LoadedModel:
    """A weaker draft: the same model with fewer layers (shares embeddings and head)."""
    cfg = ModelConfig(**{**loaded.config.to_dict(), "num_layers": layers})
    model = CausalLM(cfg)
    state = {k: v for k, v in loaded.model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    return LoadedModel(name, cfg, model, loaded.tokenizer, Path("."), Path("."), True)


def perturbed(loaded: LoadedModel, noise: float, seed: int = 100, name: str = "tiny-perturbed") -> LoadedModel:
    """A draft that agrees with the target only partly: its weights plus Gaussian noise."""
    model = CausalLM(loaded.config)
    model.load_state_dict(loaded.model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    model.eval().requires_grad_(False)
    return LoadedModel(name, loaded.config, model, loaded.tokenizer, Path("."), Path("."), True)


PROMPTS = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7], [3, 3, 3, 3, 8, 40, 2, 11, 60, 1, 5]]


def weak_pair() -> tuple[LoadedModel, LoadedModel]:
    """A peaky 3-layer target and its 1-layer truncation: acceptance well below 1."""
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    return target, truncated(target, 1)


def greedy_tokens(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy AR outputs from the engine, each prompt prefilled in one pass: the reference every speculative mode
    and every chunking must equal."""
    from saguaro import LLM, SamplingParams
    with LLM(loaded, block_size=4, max_prefill_tokens=1 << 20) as llm:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]


def arriving(engine, prompts: list[list[int]], params, steps_between: int = 1) -> list:
    """Each prompt after the first added ``steps_between`` engine steps after the one before, while those decode
    (so prefill chunks and decode rounds interleave), then steps to the end; the sequences, in prompt order."""
    seqs = [engine.add_request(prompts[0], params)]
    for prompt in prompts[1:]:
        for _ in range(steps_between):
            engine.step()
        seqs.append(engine.add_request(prompt, params))
    while engine.has_unfinished:
        engine.step()
    return seqs


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


def save_hf(loaded: LoadedModel, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``loaded`` as an HF directory (config.json, model.safetensors in ``dtype``, tokenizer.json and a chat
    template), so that a path reaches it as it reaches a real checkpoint: the CLI, tensor-parallel ranks, the
    mapped loader."""
    import json

    from safetensors.torch import save_file
    cfg = loaded.config
    directory.mkdir(parents=True, exist_ok=True)
    hf = dict(model_type=cfg.arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
              rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
              torch_dtype=str(dtype).removeprefix("torch."),
              eos_token_id=cfg.eos_token_ids or None)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file({k: v.to(dtype).contiguous() for k, v in loaded.model.state_dict().items()},
              str(directory / "model.safetensors"))
    loaded.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return directory


def every_mode(target: LoadedModel, draft: LoadedModel):
    """(mode, engine) for AR, SD with ``draft``, n-gram SD and SSD over one target, each engine made when reached
    (close it after use): the set an exactness test runs one case through."""
    from saguaro import LLM
    common = dict(block_size=4)
    yield "ar", LLM(target, **common)
    yield "sd", LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=3, **common)
    yield "ngram", LLM(target=target, mode="sd", proposer="ngram", num_speculative_tokens=3, **common)
    yield "ssd", LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=3, fan_out=[2, 2, 2, 4],
                     worker_timeout_s=60, **common)
