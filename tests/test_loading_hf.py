"""Tiny random HF checkpoints (llama with llama3 RoPE scaling, qwen2, qwen3) saved with
``save_pretrained`` and loaded through saguaro.loading: our logits must match transformers'
in fp32 for the prefill and for 20 decode steps through a paged cache whose blocks are
handed out in a scrambled order."""
from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.loading import ModelDirectoryError, WeightMismatchError, load_model

VOCAB = 97
BLOCK = 4
DECODE_STEPS = 20

ARCHS = {
    "llama": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=24)),
}


def _write_tokenizer(directory) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<s>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = HFTokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }} {% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "chat_template": template}))


def _save_tiny(arch: str, directory, shard: bool = False) -> transformers.PreTrainedModel:
    cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf_config = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, **extra)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0; perturb so they matter
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(directory, max_shard_size="100KB" if shard else "1GB")
    _write_tokenizer(directory)
    return ref


def _slots(length: int, order: list[int]) -> list[int]:
    return [order[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)]


def _compare(arch: str, directory, ref) -> None:
    torch.manual_seed(1)
    loaded = load_model(directory, progress=False)
    model, cfg = loaded.model, loaded.config
    num_blocks = 16
    order = list(range(num_blocks))
    random.Random(arch).shuffle(order)  # non-contiguous block table
    cache = KVCache(cfg, num_blocks, BLOCK, torch.float32)
    prompt = torch.randint(0, VOCAB, (11,)).tolist()
    seq = list(prompt)
    with torch.no_grad():
        n = len(seq)
        hidden = model(torch.tensor(seq), torch.arange(n), cache, build_metadata([_slots(n, order)], [n]))
        ours = model.logits(hidden)
        theirs = ref(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        for step in range(DECODE_STEPS):
            token = int(ours[-1].argmax())
            seq.append(token)
            n = len(seq)
            hidden = model(torch.tensor([token]), torch.tensor([n - 1]), cache,
                           build_metadata([_slots(n, order)], [1]))
            ours = model.logits(hidden)
            theirs = ref(torch.tensor([seq])).logits[0, -1:].float()
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_directory_matches_transformers(arch, tmp_path):
    ref = _save_tiny(arch, tmp_path)
    _compare(arch, tmp_path, ref)


def test_sharded_checkpoint_and_metadata(tmp_path):
    ref = _save_tiny("qwen2", tmp_path, shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _compare("qwen2", tmp_path, ref)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.arch == "qwen2" and loaded.config.attention_bias
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert not loaded.model.training
    tok = loaded.tokenizer
    assert tok.eos_token_ids[0] == VOCAB - 1 and tok.bos_token_id == VOCAB - 2
    assert tok.apply_chat_template([{"role": "user", "content": "w1 w2"}]) == "user: w1 w2</s> "
    assert tok.encode("w3 w4", add_special_tokens=False) == [3, 4]


def test_llama3_scaling_and_tie_are_read(tmp_path):
    _save_tiny("llama", tmp_path)
    cfg = load_model(tmp_path, progress=False).config
    assert cfg.tie_word_embeddings
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"


def test_bf16_load_casts(tmp_path):
    _save_tiny("qwen3", tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model.rotary.inv_freq.dtype == torch.float32  # RoPE frequencies stay exact


def test_directory_errors(tmp_path):
    with pytest.raises(ModelDirectoryError, match="config.json"):
        load_model(tmp_path, progress=False)
    _save_tiny("qwen2", tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelDirectoryError, match="tokenizer.json"):
        load_model(tmp_path, progress=False)
    _write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightMismatchError, match="missing"):
        load_model(tmp_path, progress=False)
