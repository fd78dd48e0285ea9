"""The bf16 fast path: the same forward as ``CausalLM``, over prepacked weights and C++ kernels.

The kernels come in tiers chosen from the CPU's features (``build.py``: avx512, avx2, portable); every tier
runs every model and weight format, only speed differs. The figures below are the avx512 tier's.

Why: one decode step reads every weight once, so its cost is weight bytes / memory
bandwidth. On one core (2-core Zen 4 dev machine, ``torch.set_num_threads(1)``) PyTorch
eager streams bf16 weights at ~10 GB/s through ``F.linear`` and ~17 GB/s through oneDNN's
prepacked linear. ``torch.compile`` (freezing, max-autotune, CPP GEMM template) reaches the
bandwidth on a lone matrix-vector product, but compiling the whole 0.5B model took 1.5-8
minutes per row count (autotuning, no cache hits with frozen weights) and the compiled
decode step still took 0.12 s, its fused attention/cache-write kernels being slow. The
kernels in ``csrc/cpu_bf16.cpp`` stream the packed weights at ~35 GB/s, the single-core
bandwidth in huge pages (a sum over a huge-page tensor reads ~35 GB/s, over 4 KB pages ~31),
for 1 to 6 rows alike, so verifying K+1 <= 6 tokens or stepping a small batch costs about
what one token does (more rows are bound by vdpbf16ps throughput). Nothing is traced, so
row counts, context lengths and masks never recompile; the one-time cost is building the
extension (about a minute per tier, then cached) and packing at load (2-5 s for the 1.5B, mostly
faulting in 3 GB of huge pages).

What ``FastCausalLM`` does at construction:
  * fuses q/k/v into one matrix (and bias), and gate/up into one matrix whose tiles pair
    32 gate rows with the matching 32 up rows, so SwiGLU is the GEMM's epilogue;
  * packs every matrix, the output head included, into one arena of 2 MB pages, or maps it packed from the
    arena cache (``arena_cache.py``: stored by the first load of weights mapped from a file);
  * keeps the embedding table and the norms (Qwen3's per-head q/k norms included) as they are (shared with
    the eager model);
  * hands each source matrix's pages back right after packing it (``host_memory.MappedPages``), when it is
    mapped from the weights file: the arena is then the one resident copy (3.1 GB for the 1.5B, where
    keeping both held 6.2 GB), a quantized pack never holds more than one bf16 matrix (the head, o and down
    only PACK_ROWS rows of one at a time), and the eager model
    still reads its weights, faulting them in again from the file. Weights built in memory stay resident.

Rounding follows the eager model op by op (bf16 results, fp32 accumulation), so outputs
agree with eager up to bf16 rounding; logits are rounded to bf16 values like the eager
head's. fp32 models never come here: they stay on the exact eager path.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from saguaro.host_memory import MappedPages, trim_heap
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata
from saguaro.backends.cpu_kernels import arena_cache, build as kernels
from saguaro.backends.cpu_kernels.layout import I4_BLOCK, TILE, matrix_bytes, packed_view, packer, tiles
from saguaro.models.transformer import CausalLM

log = logging.getLogger("saguaro.fast")
SWIGLU = 1
ROUND_BF16 = 2  # gemm epilogues (csrc/cpu_bf16.cpp)
# Rows of one matrix packed at a time (a multiple of TILE): the 1.5B's head is 467 MB in bf16, its source pages
# and the packer's staging copy of it were resident together (a quantized pack's peak: 0.6 GB over its arena).
PACK_ROWS = 8192


def unsupported_reason(model: CausalLM, weights: str = "bf16") -> str | None:
    """Why ``model`` cannot take the fast path (with ``weights`` packed as bf16, int8 or int4), or None if it can."""
    cfg = model.config
    if weights not in WEIGHT_FORMATS:
        return f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}"
    if weights != "bf16" and any(k % 32 for k in (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                                                   cfg.intermediate_size)):
        return f"{weights} weights need hidden, attention and intermediate sizes that are multiples of 32"
    dtype = model.model.embed_tokens.weight.dtype
    if dtype != torch.bfloat16:
        return f"the fast path is bf16 only (model is {dtype})"
    if model.model.embed_tokens.weight.device.type != "cpu":
        return "the fast path runs on CPU only"
    d = cfg.head_dim
    if d % 16 or d > 256 or (d // 16) & (d // 16 - 1):
        return f"head_dim {d} not supported (16, 32, 64, 128 or 256)"
    if cfg.hidden_size % 2 or cfg.intermediate_size % 32:
        return "hidden size must be even and intermediate size a multiple of 32"
    return None


def matrix_shapes(cfg, head_rows: int) -> list[tuple[int, int]]:
    """The [n, k] shapes the fast path packs, in arena order: per layer qkv, o, gate/up, down; then the head."""
    h, q_cols = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    per_layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, h), (h, q_cols),
                 (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return per_layer * cfg.num_layers + [(head_rows, h)]


def pass_bytes(cfg, weights: str = "bf16", head_rows: int | None = None) -> int:
    """Weight bytes one forward pass streams on the fast path (every packed matrix once)."""
    return sum(matrix_bytes(n, k, weights) for n, k in matrix_shapes(cfg, head_rows or cfg.vocab_size))


WEIGHT_FORMATS = kernels.WEIGHT_FORMATS


class _Arena:
    """One huge-page allocation holding every packed matrix back to back.

    bf16 tiles are [K/2, 64, 2] values; int8 tiles are [K/4, 64, 4] bytes followed by the 64
    outputs' fp32 scales; int4 tiles are K/32 blocks of I4_BLOCK bytes (csrc/quant_pack.h).
    """

    def __init__(self, nbytes: int, weights: str, ops, buffer: torch.Tensor | None = None):
        assert ops.I4_BLOCK == I4_BLOCK
        self.weights = weights
        self.buffer = ops.alloc_huge(nbytes) if buffer is None else buffer  # or packed already (arena_cache)
        self.offset = 0

    def take(self, n: int, k: int) -> torch.Tensor:
        size = matrix_bytes(n, k, self.weights)
        chunk = self.buffer[self.offset:self.offset + size]
        self.offset += size
        return packed_view(chunk, n, k, self.weights)


def _metadata_tensors(meta: AttentionMetadata) -> list[torch.Tensor]:
    """slot_mapping, query_index, query_valid, context_slots, mask: contiguous, as the kernels read them."""
    return [t.contiguous() for t in (meta.slot_mapping, meta.query_index, meta.query_valid, meta.context_slots,
                                     meta.mask)]


class _Layer:
    __slots__ = ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down", "q_norm", "k_norm")


class FastCausalLM:
    """``forward``/``logits`` with the signatures of ``CausalLM``, over packed weights.

    ``weights="int8"`` quantizes every matrix per output channel (for drafts: half the bytes
    of bf16 per step); ``weights="int4"`` per group of 32 inputs (5 bits a weight with the
    group's fp16 scale and offset: under a third of bf16's bytes). ``head_ids`` keeps only those rows of the
    output head; every other token gets logit -inf, so a draft never proposes it (for drafts: the head is a
    quarter of a 0.5B model's bytes). Neither is exact, so neither belongs on a target. ``tier`` picks the
    kernel tier (default: ``build.chosen_tier()``).
    """

    taps: tuple[int, ...] = ()  # as CausalLM's: layers whose input a pass keeps in ``tapped``

    def __init__(self, model: CausalLM, weights: str = "bf16", head_ids: torch.Tensor | None = None,
                 tier: str | None = None):
        self.tapped: torch.Tensor | None = None
        reason = unsupported_reason(model, weights)
        if reason:
            raise ValueError(reason)
        self.ops = kernels.load(tier)
        self.tier = self.ops.TIER
        self.config = cfg = model.config
        self.model = model
        self.weights = weights
        d = cfg.head_dim
        self.q_cols = cfg.num_heads * d
        self.qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        head = model.model.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
        self.head_ids = None
        if head_ids is not None:
            self.head_ids = torch.as_tensor(head_ids, dtype=torch.long).unique()
            if len(self.head_ids) == 0 or self.head_ids[0] < 0 or self.head_ids[-1] >= cfg.vocab_size:
                raise ValueError(f"head_ids must be non-empty token ids below {cfg.vocab_size}")
            # the kept ids' leading run 0, 1, 2, ... (a draft keeps the first ids and the special tokens): logits
            # copies it as one block and scatters only the rest. Sorted and unique, ids[i] == i only in that run.
            self.head_run = int((self.head_ids == torch.arange(len(self.head_ids))).sum())
        head_rows = head.shape[0] if self.head_ids is None else len(self.head_ids)
        nbytes = sum(matrix_bytes(n, k, weights) for n, k in matrix_shapes(cfg, head_rows))
        pages = MappedPages()
        key = arena_cache.key_for([pages.path(p) for p in model.parameters()], weights, self.tier, self.head_ids,
                                  nbytes)
        cached = arena_cache.load(key) if key is not None else None
        arena = _Arena(nbytes, weights, self.ops, cached)
        self._pack(model, arena, head, pages if cached is None else None)
        if key is not None and cached is None:
            arena_cache.store_in_background(key, arena.buffer)  # the load returns while it writes
        self.arena = arena.buffer
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        self.rotary = model.rotary
        empty = torch.empty(0, dtype=torch.bfloat16)
        self.flat_weights = [w for layer in self.layers for w in (
            layer.ln1, layer.qkv, empty if layer.qkv_bias is None else layer.qkv_bias, layer.o, layer.ln2,
            layer.gate_up, layer.down, layer.q_norm, layer.k_norm)]
        self.scale = d ** -0.5

    def _pack(self, model: CausalLM, arena: _Arena, head: torch.Tensor, pages: MappedPages | None) -> None:
        """Lay out every layer's matrices and the head in ``arena``, packing them unless ``pages`` is None (an
        arena mapped packed from the cache) and handing each source's mapped pages back as soon as it is packed
        (so a quantized pack holds one bf16 matrix at a time)."""
        cfg, h, inter, weights = self.config, self.config.hidden_size, self.config.intermediate_size, self.weights
        self.layers = []

        def pack(dst: torch.Tensor, sources: list[torch.Tensor], epilogue: int) -> None:
            if pages is not None:
                pack_with(dst, sources, epilogue)
                pages.release(*sources)  # the arena holds them now

        def pack_rows(dst: torch.Tensor, source: torch.Tensor, ids: torch.Tensor | None = None) -> None:
            """One source's rows (or its rows ``ids``, ascending) packed PACK_ROWS at a time, each chunk's mapped
            pages handed back once packed: a chunk, not the whole matrix, is resident in bf16 (twice: the source's
            pages and the packer's staging copy)."""
            n = source.shape[0] if ids is None else len(ids)
            for start in range(0, n if pages is not None else 0, PACK_ROWS):
                end = min(start + PACK_ROWS, n)
                rows = source[start:end] if ids is None else source[ids[start:end]]
                pack_with(dst[start // TILE:tiles(end)], [rows], 0)
                pages.release(source[start:end] if ids is None else source[ids[start]:ids[end - 1] + 1])

        pack_with = packer(self.ops, weights)
        with torch.no_grad():
            for block in model.model.layers:
                attn, mlp, layer = block.self_attn, block.mlp, _Layer()
                layer.ln1, layer.ln2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
                layer.q_norm, layer.k_norm = ((attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm
                                              else (torch.empty(0, dtype=torch.bfloat16),) * 2)
                layer.qkv = arena.take(self.qkv_rows, h)
                pack(layer.qkv, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0)
                layer.qkv_bias = (torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)).contiguous()
                                  if attn.q_proj.bias is not None else None)
                layer.o = arena.take(h, self.q_cols)
                pack_rows(layer.o, attn.o_proj.weight)
                layer.gate_up = arena.take(2 * inter, h)
                pack(layer.gate_up, [mlp.gate_proj.weight, mlp.up_proj.weight], SWIGLU)
                layer.down = arena.take(h, inter)
                pack_rows(layer.down, mlp.down_proj.weight)
                self.layers.append(layer)
            self.head = arena.take(head.shape[0] if self.head_ids is None else len(self.head_ids), h)
            pack_rows(self.head, head, self.head_ids)
        if pages is not None:
            pages.release(head)
            trim_heap()
            log.debug("packed %d MB of %s weights; released %d MB of mapped eager weights",
                      arena.buffer.numel() >> 20, weights, pages.released >> 20)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.forward(input_ids, positions, cache, meta)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [N, hidden] for N new tokens; their k/v land in ``cache``.

        All layers run in one C++ call (``forward_layers``); ``forward_stepwise`` is the same
        computation one kernel call at a time, kept as its readable reference.
        """
        cfg = self.config
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(positions, torch.bfloat16)
        cos, sin, meta_tensors = cos.contiguous(), sin.contiguous(), _metadata_tensors(meta)

        def layers(x: torch.Tensor, start: int, end: int) -> torch.Tensor:  # layers [start, end) in one call
            return self.ops.forward_layers(x, cos, sin, cache.data[start:end], *meta_tensors,
                                           self.flat_weights[9 * start:9 * end], cfg.num_heads, cfg.num_kv_heads,
                                           cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps, self.scale)

        start, kept = 0, {}
        for tap in sorted(set(self.taps)):  # an EAGLE-3 draft's features: stop at each tapped layer's input
            x = kept[tap] = layers(x, start, tap) if tap > start else x
            start = tap
        x = layers(x, start, cfg.num_layers)
        if self.taps:
            self.tapped = torch.cat([kept[i] for i in self.taps], -1)
        return self.ops.rms_norm(x, self.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward_stepwise(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                         meta: AttentionMetadata) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(positions, torch.bfloat16)
        cos, sin = cos.contiguous(), sin.contiguous()
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(i)
            qkv = ops.gemm(ops.rms_norm(x, layer.ln1, eps), layer.qkv, self.qkv_rows, layer.qkv_bias, None, 0, False)
            slots, *attn_meta = _metadata_tensors(meta)
            ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, d, layer.q_norm, layer.k_norm, eps)
            attn = ops.attention(qkv, k_cache, v_cache, *attn_meta, heads, kv_heads, d, self.scale)
            x = ops.gemm(attn, layer.o, cfg.hidden_size, None, x, 0, False)  # + residual in the epilogue
            act = ops.gemm(ops.rms_norm(x, layer.ln2, eps), layer.gate_up, 2 * cfg.intermediate_size, None, None,
                           SWIGLU, False)  # silu(gate) * up in the epilogue
            x = ops.gemm(act, layer.down, cfg.hidden_size, None, x, 0, False)
        return ops.rms_norm(x, self.norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given hidden rows, rounded to bf16 values as the eager head's are.

        Without the rounding greedy decoding would break near-ties differently from eager and
        transformers (measured: 3 of 6 greedy 48-token outputs diverged from eager, one at the
        first token; with it 5 of 6 match, the sixth after 25 tokens).
        """
        if self.head_ids is None:
            return self.ops.gemm(hidden.contiguous(), self.head, self.config.vocab_size, None, None, ROUND_BF16, True)
        kept = self.ops.gemm(hidden.contiguous(), self.head, len(self.head_ids), None, None, ROUND_BF16, True)
        run = self.head_run
        full = kept.new_empty((hidden.shape[0], self.config.vocab_size))
        full[:, :run] = kept[:, :run]
        full[:, run:] = float("-inf")
        return full.index_copy_(1, self.head_ids[run:], kept[:, run:])


def fast_or_eager(model: CausalLM, weights: str = "bf16",
                  head_ids: torch.Tensor | None = None) -> "FastCausalLM | CausalLM":
    """``FastCausalLM(model, ...)`` where the fast path applies, else ``model`` itself (logged).

    int8/int4 weights and a reduced head exist only on the fast path, so asking for them where it
    cannot run is an error rather than a silent fall back to the full bf16 eager model.
    """
    reason = unsupported_reason(model, weights)
    if reason is None:
        try:
            return FastCausalLM(model, weights, head_ids)
        except kernels.KernelsUnavailable as e:
            reason = str(e)
    if weights != "bf16" or head_ids is not None:
        raise ValueError(f"int8/int4 weights and a reduced head need the fast path, which cannot run here: {reason}")
    log.warning("fast path off, running eager: %s", reason)
    return model
