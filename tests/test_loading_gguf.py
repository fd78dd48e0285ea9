"""GGUF round trip on tiny models: a random HF model written out the way llama.cpp's converter
writes it (GGUF names, q/k rows permuted for llama, Q8_0/F16/F32 tensors), loaded back
through the converted cache, must reproduce the HF model's logits. Covers qwen3 (q/k norm,
explicit head_dim), which no shipped file exercises, plus the cache mechanics: hits,
stale rebuilds, interrupted conversions and derived bf16 copies."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")  # absent on the GPU machine unless its wheel is carried
Q = gguf.GGMLQuantizationType

from saguaro.kv.kv_cache import KVCache  # noqa: E402
from saguaro.kv.metadata import build_metadata  # noqa: E402
from saguaro.loading import GGUFFormatError, UnsupportedModelError, load_model  # noqa: E402
from saguaro.loading import converted_cache, gguf_loader  # noqa: E402
from saguaro.loading.chunks import file_sha256  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2

_LAYER_NAMES = {v: k for k, v in gguf_loader._LAYER_MAP.items()}
_GLOBAL_NAMES = {v: k for k, v in gguf_loader._GLOBAL_MAP.items()}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (what byte-level BPE vocabularies store)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = _byte_tokens() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
VOCAB = len(TOKENS)


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf]
    _, _, index, rest = hf.split(".", 3)
    return f"blk.{index}.{_LAYER_NAMES[rest]}"


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny(arch: str, tmp_path, extra_tensor: str | None = None, arch_name: str | None = None):
    """Write a tiny GGUF for ``arch``; return (path, HF reference holding the same dequantized weights)."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    extra = {"head_dim": 24} if arch == "qwen3" else {}
    torch.manual_seed(0)
    cfg = cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
              tie_word_embeddings=arch == "llama", rope_theta=50000.0, rms_norm_eps=1e-5, **extra)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    head_dim = getattr(cfg, "head_dim", None) or HIDDEN // HEADS
    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * 258 + [3, 3, 3])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    state = {}
    with torch.no_grad():
        for name, param in ref.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            w = param.numpy().astype(np.float32)
            if w.ndim == 1:  # norms and biases: perturb so they matter, store as F32
                w = w + np.random.default_rng(len(state)).normal(0, 0.1, w.shape).astype(np.float32)
                qtype = Q.F32
            else:
                qtype = Q.F16 if "embed" in name else Q.Q8_0
            stored = w
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                stored = _llama_cpp_permute(w, HEADS if "q_proj" in name else KV_HEADS)
            if qtype == Q.F32:
                writer.add_tensor(_gguf_name(name), stored)
            elif qtype == Q.F16:
                writer.add_tensor(_gguf_name(name), stored.astype(np.float16))
            else:
                data = gguf.quants.quantize(stored, qtype)
                writer.add_tensor(_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
            # the reference gets exactly the values the file decodes to
            back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype) if qtype == Q.Q8_0 else w
            state[name] = torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(w.shape).copy())
            if qtype == Q.F16:
                state[name] = state[name].half().float()
        if extra_tensor:
            writer.add_tensor(extra_tensor, np.ones(head_dim // 2, dtype=np.float32))
        ref.load_state_dict(state, strict=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, ref


def _check_logits(loaded, ref, steps: int = 6) -> None:
    torch.manual_seed(3)
    cache = KVCache(loaded.config, 8, 4, torch.float32)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    slots = [order[i // 4] * 4 + i % 4 for i in range(32)]
    seq = torch.randint(0, VOCAB, (9,)).tolist()
    with torch.no_grad():
        ours = loaded.model.logits(loaded.model(torch.tensor(seq), torch.arange(len(seq)), cache,
                                                build_metadata([slots[:len(seq)]], [len(seq)])))
        torch.testing.assert_close(ours, ref(torch.tensor([seq])).logits[0], rtol=1e-4, atol=1e-5)
        for _ in range(steps):
            seq.append(int(ours[-1].argmax()))
            ours = loaded.model.logits(loaded.model(torch.tensor(seq[-1:]), torch.tensor([len(seq) - 1]), cache,
                                                    build_metadata([slots[:len(seq)]], [1])))
            torch.testing.assert_close(ours, ref(torch.tensor([seq])).logits[0, -1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(arch, tmp_path):
    path, ref = _tiny(arch, tmp_path)
    loaded = load_model(path, progress=False)
    cfg = loaded.config
    assert cfg.arch == arch and cfg.tie_word_embeddings == (arch == "llama")
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.head_dim == (24 if arch == "qwen3" else HIDDEN // HEADS)
    assert cfg.bos_token_id == VOCAB - 2 and cfg.eos_token_ids[0] == VOCAB - 1
    _check_logits(loaded, ref)
    tok = loaded.tokenizer
    assert tok.vocab_size == VOCAB
    assert tok.decode(tok.encode("the tea")) == "the tea"
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [VOCAB - 1]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_cache_hit_stale_rebuild_and_direct_load(tmp_path):
    path, ref = _tiny("qwen2", tmp_path)
    first = load_model(path, progress=False)
    assert not first.cache_hit
    assert first.weights_dir.name.startswith("tiny-qwen2-") and first.weights_dir.parent == tmp_path / "cache"
    assert json.loads((first.weights_dir / "source.json").read_text())["dtype"] == "float32"
    again = load_model(path, progress=False)
    assert again.cache_hit and again.weights_dir == first.weights_dir
    direct = load_model(first.weights_dir, progress=False)  # a converted directory loads on its own
    _check_logits(direct, ref, steps=1)
    info = json.loads((first.weights_dir / "source.json").read_text())
    info["sha256"] = "0" * 64  # as if the GGUF had changed since conversion
    (first.weights_dir / "source.json").write_text(json.dumps(info))
    rebuilt = load_model(path, progress=False)
    assert not rebuilt.cache_hit
    weights = first.weights_dir / "model.safetensors"
    with open(weights, "r+b") as f:  # a truncated weights file is not a valid cache either
        f.truncate(weights.stat().st_size - 100)
    assert not load_model(path, progress=False).cache_hit
    _check_logits(load_model(path, progress=False), ref, steps=1)


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    path, _ = _tiny("llama", tmp_path)
    real = gguf_loader.GGUFModel.tensor
    seen = []

    def dying(self, name):
        seen.append(name)
        if len(seen) == 5:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-conversion
        return real(self, name)

    monkeypatch.setattr(gguf_loader.GGUFModel, "tensor", dying)
    with pytest.raises(KeyboardInterrupt):
        load_model(path, progress=False)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["hashes"]
    monkeypatch.setattr(gguf_loader.GGUFModel, "tensor", real)
    assert not load_model(path, progress=False).cache_hit


def test_dead_writer_temporaries_are_swept(tmp_path):
    path, _ = _tiny("qwen2", tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    key = converted_cache.cache_key(path, file_sha256(path, progress=False))
    stale = cache / f".{key}.tmp-999999999-abcd"  # no such pid
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    load_model(path, progress=False)
    assert not stale.exists()


def test_bf16_copy_is_derived_once(tmp_path):
    path, ref = _tiny("qwen3", tmp_path)
    fp32 = load_model(path, progress=False)
    bf16 = load_model(path, dtype=torch.bfloat16, progress=False)
    copy = bf16.weights_dir / "model.bfloat16.safetensors"
    assert copy.is_file() and all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    stamp = copy.stat().st_mtime_ns
    load_model(path, dtype=torch.bfloat16, progress=False)
    assert copy.stat().st_mtime_ns == stamp  # reused, not rewritten
    w32 = fp32.model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(bf16.model.model.layers[0].mlp.up_proj.weight, w32.to(torch.bfloat16))


def test_unsupported_gguf_features(tmp_path):
    path, _ = _tiny("llama", tmp_path, extra_tensor="rope_freqs.weight")
    with pytest.raises(UnsupportedModelError, match="RoPE frequency factors"):
        load_model(path, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    path, _ = _tiny("llama", other, arch_name="gemma3")
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, qwen3"):
        load_model(path, progress=False)


def test_gguf_without_tensors_section(tmp_path):
    path, _ = _tiny("qwen2", tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 3000])
    with pytest.raises(GGUFFormatError, match="truncated"):
        load_model(cut, progress=False)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0"])
def test_dequantizing_in_row_chunks_equals_whole(qtype, monkeypatch):
    """Rows dequantized a chunk at a time (chunks ending mid-tensor) give the whole tensor's values exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    kind = GGMLQuantizationType[qtype]
    weights = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    plain = np.float16 if qtype == "F16" else np.float32
    raw = quantize(weights, kind) if qtype.startswith("Q") else weights.astype(plain)
    raw.flags.writeable = False  # as the file map hands it over
    monkeypatch.setattr(gguf_loader, "DEQUANT_ROWS", 5)
    chunked = gguf_loader.dequantize_rows(raw, kind)
    assert chunked.dtype == np.float32 and chunked.flags.writeable and chunked.shape == (37, 64)
    assert np.array_equal(chunked, np.asarray(dequantize(raw, kind), dtype=np.float32))
