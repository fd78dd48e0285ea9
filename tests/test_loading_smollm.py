"""The real SmolLM2-135M GGUF (llama architecture, Q4_1/Q8_0, tied embeddings): our fp32
greedy continuation must equal transformers' greedy continuation of the same file, token
for token. This pins the GGUF config reading, the llama.cpp q/k un-permutation, the
dequantization and the name mapping against an independent implementation."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.loading import MODELS, installed, load_model

NEW_TOKENS = 32
BLOCK = 4

pytestmark = pytest.mark.skipif(not installed(MODELS["smollm2-135m"]),
                                reason=f"needs {MODELS['smollm2-135m'].pip_command}")


@pytest.fixture(scope="module")
def ours():
    torch.set_num_threads(1)
    return load_model("smollm2-135m", dtype=torch.float32, progress=False)


def _reference_model(path):
    """transformers' own GGUF loading (dequantize + reverse permutation) of the same file."""
    if importlib.util.find_spec("accelerate") is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # from_pretrained(gguf_file=...) insists on accelerate; this is the same loader it calls
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    try:  # skip the random init of weights that are overwritten right away (saves ~10 s on 0.5B)
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def _reference_greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


def _our_greedy(loaded, ids: list[int], n: int) -> list[int]:
    blocks = (len(ids) + n) // BLOCK + 1
    order = list(reversed(range(blocks)))  # non-contiguous, descending block table
    slots = [order[i // BLOCK] * BLOCK + i % BLOCK for i in range(blocks * BLOCK)]
    cache = KVCache(loaded.config, blocks, BLOCK, torch.float32)
    model, seq, out = loaded.model, list(ids), []
    with torch.no_grad():
        hidden = model(torch.tensor(seq), torch.arange(len(seq)), cache, build_metadata([slots[:len(seq)]], [len(seq)]))
        for _ in range(n):
            token = int(model.logits(hidden[-1:]).argmax())
            out.append(token)
            seq.append(token)
            hidden = model(torch.tensor([token]), torch.tensor([len(seq) - 1]), cache,
                           build_metadata([slots[:len(seq)]], [1]))
    return out


def test_config_from_gguf(ours):
    cfg = ours.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and not hasattr(ours.model, "lm_head")
    assert cfg.vocab_size == 49152 and ours.tokenizer.vocab_size == 49152
    assert ours.tokenizer.eos_token_ids[0] == 2 and ours.tokenizer.bos_token_id == 1


def test_greedy_matches_transformers(ours):
    ref = _reference_model(ours.source)
    tok = ours.tokenizer
    prompts = [
        tok.encode("def fibonacci(n):"),
        tok.encode("The capital of France is"),
        tok.encode_chat([{"role": "user", "content": "What is 2+2? Answer briefly."}]),
    ]
    for ids in prompts:
        expected = _reference_greedy(ref, ids, NEW_TOKENS)
        got = _our_greedy(ours, ids, NEW_TOKENS)
        assert got == expected, f"prompt {tok.decode(ids)!r}: ours {tok.decode(got)!r} vs {tok.decode(expected)!r}"


def test_tokenizer_and_template_match_transformers(ours):
    path = ours.source
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = ours.tokenizer
    for text in ["Hello world!", "def f(x):\n    return x ** 2  # 12345", "héllo <|im_start|> ünïcode"]:
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Write a haiku."}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=True)
