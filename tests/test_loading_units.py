"""Small pieces of the loading layer: the streaming safetensors writer, the llama.cpp q/k
un-permutation, GGUF name mapping, and the tokenizer's chat templating and vocabulary check."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from saguaro.loading.gguf_loader import hf_name, unpermute_rope_rows
from saguaro.loading.safetensors_stream import read_streaming, write_streaming
from saguaro.loading.tokenizer import (ChatTemplateError, Tokenizer, VocabularyMismatchError,
                                       check_shared_vocabulary)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (the transformation we must invert)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 64), (4, 8)])
def test_unpermute_inverts_llama_cpp(heads, head_dim):
    w = torch.randn(heads * head_dim, 17)
    assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(w, heads), heads), w)
    # the layout really changes: rows of a head come back as (first half, second half)
    interleaved = _llama_cpp_permute(w, heads)
    assert torch.equal(interleaved[1], w[head_dim // 2])


def test_gguf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.17.attn_k.bias") == "model.layers.17.self_attn.k_proj.bias"
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streaming_safetensors_round_trip(tmp_path, dtype):
    tensors = {"a.weight": torch.randn(7, 5), "b": torch.randn(3), "c.big": torch.randn(2, 3, 4)}
    path = tmp_path / "x.safetensors"
    write_streaming(path, [(k, tuple(v.shape)) for k, v in tensors.items()], dtype, tensors.__getitem__,
                    metadata={"format": "pt"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == dtype and torch.equal(back[k], v.to(dtype))
    with pytest.raises(ValueError, match="declared"):
        write_streaming(path, [("a", (2, 2))], dtype, lambda name: torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streaming_read_equals_safetensors(tmp_path, dtype):
    """``read_streaming`` reads what the safetensors library wrote (its own order, empty tensors included) and
    refuses a truncated file."""
    from safetensors.torch import save_file
    tensors = {"z.last": torch.randn(4, 6).to(dtype), "a.first": torch.randn(9).to(dtype),
               "empty": torch.zeros(0, 3, dtype=dtype)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    entries, read = read_streaming(path)
    assert dict(entries) == {k: tuple(v.shape) for k, v in tensors.items()}
    for name, _ in entries:
        assert read(name).dtype == dtype and torch.equal(read(name), tensors[name])
    path.write_bytes(path.read_bytes()[:-8])
    last = max(entries, key=lambda e: tensors[e[0]].numel())[0]
    with pytest.raises(ValueError, match="cut short"):
        read_streaming(path)[1](last)


def test_deriving_a_dtype_copy_never_maps_the_source(tmp_path):
    """An RSS ceiling: writing the bf16 copy of a 96 MB fp32 file grows resident memory by about a tensor, where
    reading it through a mapping kept every page read resident (the negative control)."""
    import json

    from safetensors import safe_open

    from saguaro.host_memory import resident_bytes
    from saguaro.loading import converted_cache
    tensors = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(24)}  # 4 MB each
    write_streaming(tmp_path / converted_cache.WEIGHTS_FILE, [(k, tuple(v.shape)) for k, v in tensors.items()],
                    torch.float32, tensors.__getitem__)
    (tmp_path / converted_cache.SOURCE_FILE).write_text(json.dumps({"dtype": "float32"}))
    del tensors

    def peak_growth(work) -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident memory (VmHWM) to the current one
        before = resident_bytes()
        work()
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) - before

    size = (tmp_path / converted_cache.WEIGHTS_FILE).stat().st_size
    name = converted_cache.weights_file(tmp_path, torch.bfloat16, progress=False)
    grown = peak_growth(lambda: _derive_again(tmp_path, converted_cache))
    assert name == "model.bfloat16.safetensors" and grown < size / 4, (grown >> 20, size >> 20)
    back = load_file(str(tmp_path / name))
    assert all(back[k].dtype == torch.bfloat16 for k in back) and len(back) == 24

    def mapped_read():
        with safe_open(str(tmp_path / converted_cache.WEIGHTS_FILE), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k).to(torch.bfloat16)
    assert peak_growth(mapped_read) > size * 3 / 4


def _derive_again(directory, converted_cache) -> None:
    (directory / "model.bfloat16.safetensors").unlink()
    converted_cache.weights_file(directory, torch.bfloat16, progress=False)


def _word_tokenizer(words: list[str], template: str | None = None) -> Tokenizer:
    backend = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = Whitespace()
    return Tokenizer(backend, eos_token_ids=[1], bos_token_id=0, chat_template=template)


def test_template_variables_and_raise_exception():
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'bad' %}"
                "{{ raise_exception('no bad roles') }}{% endif %}[{{ m['role'] }}]{{ m['content'] | tojson }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = _word_tokenizer(["<s>", "</s>", "hi"], template)
    out = tok.apply_chat_template([{"role": "user", "content": "héllo <b>"}])
    assert out == '<s>[user]"héllo <b>"</s>[assistant]'  # tojson neither escapes HTML nor non-ASCII
    assert not tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith("]")
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _word_tokenizer(["<s>", "</s>"]).apply_chat_template([{"role": "user", "content": "x"}])


def test_vocabulary_check():
    a = _word_tokenizer(["<s>", "</s>", "x", "y"])
    same = _word_tokenizer(["<s>", "</s>", "x", "y"])
    swapped = _word_tokenizer(["<s>", "</s>", "y", "x"])
    longer = _word_tokenizer(["<s>", "</s>", "x", "y", "z"])
    check_shared_vocabulary(a, same)
    assert a.vocab_fingerprint() == same.vocab_fingerprint()
    with pytest.raises(VocabularyMismatchError, match="different ids"):
        check_shared_vocabulary(a, swapped)
    with pytest.raises(VocabularyMismatchError, match="only in target"):
        check_shared_vocabulary(a, longer)


def test_chat_template_matches_transformers_rendering(tmp_path):
    """Our jinja setup renders a tools-using (Qwen-style) template exactly like transformers."""
    transformers = pytest.importorskip("transformers")
    template = (
        "{%- if tools %}{{- '<|sys|>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '<|end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}\n  {{- '<|' + message.role + '|>' + message.content + '<|end|>\\n' }}\n"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}")
    words = ["<unk>", "<|end|>", "a"]
    backend = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.save(str(tmp_path / "tokenizer.json"))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=template)
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json", chat_template=template)
    tools = [{"type": "function", "function": {"name": "f", "description": "ü <x>", "parameters": {}}}]
    for messages, kwargs in [
        ([{"role": "user", "content": "hi"}], {}),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
          {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}], {"tools": tools}),
    ]:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == expected


def test_a_tokenizer_that_rendered_a_chat_still_pickles():
    """A draft shipped to the speculator's process carries its tokenizer; its compiled template stays behind."""
    import pickle
    from tests.tiny import tiny_tokenizer
    tok = tiny_tokenizer(64)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    back = pickle.loads(pickle.dumps(tok))
    assert back.apply_chat_template([{"role": "user", "content": "hi"}]) == text
