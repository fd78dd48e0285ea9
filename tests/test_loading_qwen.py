"""The real Qwen2.5-Coder 1.5B/0.5B pair: assembled from their PyPI chunk packages with a
sha256 check, converted once into the cache, sharing one vocabulary, and producing sensible
greedy code. The first run converts (~1.5 min for both); later runs hit the cache."""
from __future__ import annotations

import time

import pytest
import torch

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.loading import MODELS, asset_path, check_shared_vocabulary, installed, load_model
from saguaro.loading.chunks import file_sha256

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (installed(MODELS[TARGET]) and installed(MODELS[DRAFT])),
                       reason=f"needs {MODELS[TARGET].pip_command} and {MODELS[DRAFT].pip_command}"),
]


def _greedy(loaded, ids: list[int], n: int) -> list[int]:
    cache = KVCache(loaded.config, (len(ids) + n) // 16 + 1, 16, torch.float32)
    seq, out = list(ids), []
    with torch.no_grad():
        hidden = loaded.model(torch.tensor(seq), torch.arange(len(seq)), cache,
                              build_metadata([list(range(len(seq)))], [len(seq)]))
        for _ in range(n):
            token = int(loaded.model.logits(hidden[-1:]).argmax())
            out.append(token)
            seq.append(token)
            hidden = loaded.model(torch.tensor([token]), torch.tensor([len(seq) - 1]), cache,
                                  build_metadata([list(range(len(seq)))], [1]))
    return out


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    return load_model(TARGET, progress=False), load_model(DRAFT, progress=False)


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_assembled_file_checksum(name):
    spec = MODELS[name]
    path = asset_path(spec, progress=False)
    assert path.stat().st_size == spec.size
    assert file_sha256(path, progress=False) == spec.sha256


def test_pair_configs_and_shared_vocabulary(pair):
    target, draft = pair
    assert (target.config.num_layers, target.config.hidden_size, target.config.num_heads,
            target.config.num_kv_heads) == (28, 1536, 12, 2)
    assert (draft.config.num_layers, draft.config.hidden_size, draft.config.num_heads,
            draft.config.num_kv_heads) == (24, 896, 14, 2)
    for m in pair:
        assert m.config.arch == "qwen2" and m.config.attention_bias
        assert m.config.vocab_size == 151936
        assert m.tokenizer.bos_token_id == 151643 and m.tokenizer.eos_token_ids[0] == 151645
        assert m.tokenizer.chat_template and "<|im_start|>" in m.tokenizer.chat_template
    check_shared_vocabulary(draft.tokenizer, target.tokenizer)


def test_greedy_code(pair):
    target, draft = pair
    chat = draft.tokenizer.encode_chat(
        [{"role": "user", "content": "Write a Python function square(x) that returns x squared."}])
    text = draft.tokenizer.decode(_greedy(draft, chat, 32))
    print(f"{draft.name}: {text!r}")
    assert "def square(x)" in text, text
    code = target.tokenizer.encode('def square(x):\n    """Return x squared."""\n')
    text = target.tokenizer.decode(_greedy(target, code, 8))
    print(f"{target.name}: {text!r}")
    assert "return x" in text, text


def test_draft_matches_transformers(pair):
    """qwen2 specifics (q/k/v bias, untied head, Q5_0/Q6_K/Q4_K/Q8_0 decoding) against
    transformers' own GGUF loader, on the 0.5B to keep the test short."""
    draft = pair[1]
    from test_loading_smollm import _reference_greedy, _reference_model
    ref = _reference_model(draft.source)
    ids = draft.tokenizer.encode("import numpy as np\n\ndef moving_average(x, k):\n")
    with torch.no_grad():
        cache = KVCache(draft.config, len(ids) // 16 + 1, 16, torch.float32)
        ours = draft.model.logits(draft.model(torch.tensor(ids), torch.arange(len(ids)), cache,
                                              build_metadata([list(range(len(ids)))], [len(ids)])))
        theirs = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
    assert _greedy(draft, ids, 16) == _reference_greedy(ref, ids, 16)


def test_second_load_uses_converted_cache(pair):
    start = time.perf_counter()
    again = load_model(TARGET, progress=False)
    elapsed = time.perf_counter() - start
    print(f"second load of {TARGET}: {elapsed:.2f} s from {again.weights_dir}")
    assert again.cache_hit
    assert again.weights_dir == pair[0].weights_dir
    # the weights are the very same converted tensors
    assert torch.equal(again.model.model.norm.weight, pair[0].model.model.norm.weight)
