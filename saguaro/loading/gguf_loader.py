"""Read a GGUF file: metadata → ModelConfig, quantized tensors → dequantized HF-named tensors.

Only the reading lives here; converted_cache.py decides where the result is stored.

Two layout facts matter:
* GGUF lists dimensions fastest-first (``ne0, ne1``), so a weight [out, in] in PyTorch is
  recorded as shape ``(in, out)``; ``gguf``'s dequantize already returns row-major
  [out, in] data, and we report HF shapes as the reversed GGUF shape.
* llama.cpp's converter permutes the rows of Llama's q/k projections so that RoPE can
  rotate adjacent pairs (GPT-J style). Our model rotates halves (HF style), so for
  ``llama`` we undo that: within each head the rows come interleaved as
  (r0, h0, r1, h1, …) and we put them back as (r0, r1, …, h0, h1, …). Qwen2/Qwen3
  files are written without the permutation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from saguaro.models.model_config import ModelConfig

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# gguf token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL = 3
# end-of-generation tokens llama.cpp also recognises by text; instruct models end turns with
# these even when the metadata's eos_token_id names a different one
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF (truncated, corrupt, or another format)."""


class UnsupportedModelError(ValueError):
    """A valid GGUF whose architecture or features Saguaro does not implement."""


@dataclass
class GGUFModel:
    """An opened GGUF: config plus lazily dequantized tensors under HF names."""
    path: Path
    config: ModelConfig
    chat_template: str | None
    tensors: dict[str, Any]  # HF name → gguf ReaderTensor
    reader: Any

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, HF shape) for every tensor, in file order, before dequantizing anything."""
        return [(name, tuple(int(d) for d in reversed(t.shape))) for name, t in self.tensors.items()]

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32 (exact: every GGML quant decodes exactly in fp32)."""
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        out = torch.from_numpy(dequantize_rows(t.data, t.tensor_type).reshape(shape))
        if self.config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            out = unpermute_rope_rows(out, heads)
        return out


DEQUANT_ROWS = 4096  # rows dequantized at a time (see dequantize_rows)


def dequantize_rows(raw: np.ndarray, qtype: Any) -> np.ndarray:
    """A GGUF tensor's data (rows of blocks) as a new, writable float32 array, DEQUANT_ROWS rows at a time:
    gguf's numpy dequantize makes temporaries several times the size of its output, and the 0.5B's embedding
    alone is 545 MB in float32 (a conversion dequantizing it whole peaked at 2.7 GB resident)."""
    from gguf.quants import dequantize
    if raw.ndim != 2 or raw.shape[0] <= DEQUANT_ROWS:
        data = np.asarray(dequantize(raw, qtype), dtype=np.float32)
        return np.array(data) if not data.flags.writeable or not data.flags.c_contiguous else data
    first = np.asarray(dequantize(raw[:DEQUANT_ROWS], qtype), dtype=np.float32)
    out = np.empty((raw.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:DEQUANT_ROWS] = first
    for start in range(DEQUANT_ROWS, raw.shape[0], DEQUANT_ROWS):
        out[start:start + DEQUANT_ROWS] = dequantize(raw[start:start + DEQUANT_ROWS], qtype)
    return out


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleaving: per head, (pair, 2) → (2, pair)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def open_gguf(path: Path | str) -> GGUFModel:
    """Parse header and metadata; check every tensor lies inside the file. Reads no weights."""
    path = Path(path)
    reader = _read(path)
    fields = reader.fields
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        hf = hf_name(t.name)
        if hf is None:
            hint = " (pre-computed RoPE frequency factors are not supported)" if t.name == "rope_freqs.weight" else ""
            raise UnsupportedModelError(f"{path.name}: unexpected tensor {t.name!r}{hint}")
        tensors[hf] = t
    config = _config(reader, arch, tensors, path)
    template = _field(reader, "tokenizer.chat_template", None) if "tokenizer.chat_template" in fields else None
    return GGUFModel(path, config, template, tensors, reader)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return None


def _read(path: Path) -> Any:
    from gguf import GGUFReader
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFFormatError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf raises assorted ValueError/IndexError/struct errors on damage
        raise GGUFFormatError(f"{path} is truncated or corrupt: gguf cannot parse it ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFFormatError(
                f"{path} is truncated: tensor {t.name} ends at byte {end} but the file has {size} bytes")
    return reader


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFFormatError(f"GGUF metadata lacks required key {key!r}")
        return default
    return field.contents()


def _eos_ids(reader: Any) -> list[int]:
    """Metadata eos/eot/eom ids plus control tokens whose text marks the end of a turn."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = _field(reader, "tokenizer.ggml.tokens", None)
    types = _field(reader, "tokenizer.ggml.token_type", None)
    if tokens is not None and types is not None:
        for i, (text, kind) in enumerate(zip(tokens, types)):
            if kind == _TOKEN_CONTROL and text in _EOG_TEXTS and i not in ids:
                ids.append(i)
    return ids


def _config(reader: Any, arch: str, tensors: dict[str, Any], path: Path) -> ModelConfig:
    def meta(key: str, default: Any = ...) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise GGUFFormatError(f"{path.name} has no token_embd.weight tensor")
    rope_scaling = None
    scaling_type = meta("rope.scaling.type", None)
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise UnsupportedModelError(f"{path.name}: rope scaling {scaling_type!r} is not supported")
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"{path.name}: partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        arch=arch,
        vocab_size=int(embed.shape[1]),  # embedding rows (may exceed the tokenizer's vocabulary)
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="lm_head.weight" not in tensors,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(reader),
    )


def convert_tokenizer(path: Path | str, out_file: Path) -> None:
    """Write a ``tokenizers`` JSON for the GGUF's vocabulary.

    transformers already knows how to turn GGUF token/merge arrays plus the ``pre``
    tokenizer name into a correct fast tokenizer (the regex split differs per model
    family); reusing it costs ~5-10 s, paid once at conversion time.
    """
    import transformers

    path = Path(path)
    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    finally:
        transformers.logging.set_verbosity(previous)
    tok.backend_tokenizer.save(str(out_file))
