"""Cases and checks for the fused ops (``backends/paged/ops_*.py``), shared by CPU and GPU tests (not a test file).

``check_*`` run an implementation (``saguaro.backends.paged.ops_triton``, usually) against the torch
reference ``ops_torch`` on one device, over shapes that cover the kernels' masking: GQA and
MHA, a head count that is not a power of two, head_dim 64, 96 and 128, N = 1 and N = 37, ghost rows,
caches that are strided views, and rows with more than one block of columns. ``fused_forward``
is a whole decoder pass through the fused ops, the way the GPU model calls them.

Tolerance, from how the kernels differ from the reference (``ops_triton``'s docstring): they
round where eager rounds, so besides the order of a float32 sum they differ only when a value
falls near a rounding boundary, by one unit in the last place (ulp), which later steps can carry
one or two roundings further. ``assert_ulps`` allows ``ulps`` units of ``eps * scale`` per element,
where ``scale`` bounds the magnitude of the terms that element was rounded from (``|expected|``,
or for a rotated pair ``hypot(a, b)``, which rotation preserves). Triton's interpreter truncates
float32 to bfloat16 instead of rounding to nearest, which doubles each rounding error: hence the
wider bfloat16 allowance on the CPU.
"""
from __future__ import annotations

import torch

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import AttentionMetadata, build_metadata
from saguaro.loading.model_builder import build_model
from saguaro.models.model_config import ModelConfig
from saguaro.models.rope import inverse_frequencies
from saguaro.models.transformer import CausalLM, paged_attention
from saguaro.backends.paged import ops_torch
from tests.tiny import tiny_model

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def allowed_ulps(dtype: torch.dtype, interpreted: bool) -> int:
    if dtype == torch.bfloat16 and interpreted:
        return 8
    return 4 if dtype == torch.float32 else 2


def allowed_differing(dtype: torch.dtype, interpreted: bool) -> float | None:
    """The share of 16-bit elements that may differ at all (None: no bound).

    Rounding where eager rounds makes a 16-bit result differ only when a last-bit float32 difference
    straddles a rounding boundary: about 1 element in 10^4 here. A rounding skipped or added changes
    10 to 30% of them, inside the ulp bound, so this is what checks that the roundings sit where
    eager's do. Not in float32 (numpy's and torch's transcendentals differ in the last bit) and not
    in the interpreter's truncating bfloat16.
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted):
        return None
    return 0.01


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int, scale: torch.Tensor | None = None,
                what: str = "", max_differing: float | None = None) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, \
        f"{what}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    finfo = torch.finfo(expected.dtype)
    scale = expected.float().abs() if scale is None else scale.float()
    err = (actual.float() - expected.float()).abs()
    bound = ulps * finfo.eps * scale + finfo.tiny
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.numel()} elements beyond {ulps} ulp; worst "
                           f"error {float(err.max()):.3g} (expected {float(expected.flatten()[err.argmax()]):.6g})")
    differing = float((err > 0).float().mean())
    assert max_differing is None or differing <= max_differing, \
        f"{what}: {differing:.1%} of the elements differ (at most {max_differing:.0%} expected)"


def pair_scale(x: torch.Tensor) -> torch.Tensor:
    """hypot of each rotated pair (j, j + D/2), broadcast to both: the magnitude rotation keeps."""
    half = x.shape[-1] // 2
    h = torch.hypot(x[..., :half].float(), x[..., half:].float())
    return torch.cat((h, h), dim=-1)


def _randn(shape, dtype, device, gen, std=1.0):
    return (torch.randn(shape, generator=gen) * std).to(dtype).to(device)


def check_rms_norm(impl, device: str, dtypes=DTYPES, interpreted: bool = False) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for n, hidden, with_residual in ((1, 64, False), (37, 96, True), (5, 1100, True)):
            what = f"rms_norm {dtype} N={n} hidden={hidden} residual={with_residual}"
            x = _randn((n, hidden), dtype, device, gen, 3.0)
            residual = _randn((n, hidden), dtype, device, gen) if with_residual else None
            weight = (1 + _randn((hidden,), torch.float32, "cpu", gen, 0.2)).to(dtype).to(device)
            y, s = impl.rms_norm(x, weight, 1e-6, residual)
            y_ref, s_ref = ops_torch.rms_norm(x, weight, 1e-6, residual)
            if residual is not None and dtype == torch.bfloat16 and interpreted:  # truncated, not rounded
                assert_ulps(s, s_ref, 1, x.float().abs() + residual.float().abs(), what=f"{what} stream")
            else:
                assert torch.equal(s, s_ref), f"{what}: residual stream differs"  # one correctly rounded add
            assert_ulps(y, y_ref, allowed_ulps(dtype, interpreted), what=what,
                        max_differing=allowed_differing(dtype, interpreted))


def check_silu_mul(impl, device: str, dtypes=DTYPES, interpreted: bool = False) -> None:
    gen = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for n, inter in ((1, 80), (37, 40), (3, 1100)):  # 1100: two column blocks, the second one partial
            gate_up = _randn((n, 2 * inter), dtype, device, gen, 3.0)
            what = f"silu_mul {dtype} N={n} inter={inter}"
            assert_ulps(impl.silu_mul(gate_up), ops_torch.silu_mul(gate_up), allowed_ulps(dtype, interpreted),
                        what=what, max_differing=allowed_differing(dtype, interpreted))


# (N, heads, kv heads, head_dim, qk norm, ghost rows, rope scaling, strided cache view)
ROPE_CASES = (
    (37, 4, 2, 64, False, True, None, False),
    (37, 4, 1, 128, True, True, LLAMA3_SCALING, True),
    (37, 3, 3, 128, True, False, None, False),
    (1, 4, 2, 64, True, False, LLAMA3_SCALING, True),
    (1, 2, 1, 64, False, True, None, False),  # one ghost row alone: the caches stay untouched
    (5, 2, 1, 96, True, True, None, True),  # head_dim / 2 = 48 is not a power of two: a masked half
)


def rope_inputs(n, heads, kv_heads, head_dim, qk_norm, ghosts, scaling, strided, dtype, device, gen):
    """Inputs for ``rope_and_store``, on ``device``: caches prefilled with noise so that a stray write shows."""
    slots = 2 * n + 3
    qkv = _randn((n, (heads + 2 * kv_heads) * head_dim), dtype, device, gen, 2.0)
    positions = torch.randint(0, 20000, (n,), generator=gen).to(device)
    slot_mapping = torch.randperm(slots, generator=gen)[:n]
    if ghosts:
        slot_mapping[::3] = -1
    slot_mapping = slot_mapping.to(device)
    inv_freq = inverse_frequencies(head_dim, 500000.0 if scaling else 10000.0, scaling).to(device)
    pad = 16 if strided else 0  # the caches as views of a wider tensor: exercises the slot and head strides
    k_cache = _randn((slots, kv_heads, head_dim + pad), dtype, device, gen)[..., :head_dim]
    v_cache = _randn((slots, kv_heads, head_dim + pad), dtype, device, gen)[..., :head_dim]
    norms = (None, None)
    if qk_norm:
        norms = tuple((1 + _randn((head_dim,), torch.float32, "cpu", gen, 0.2)).to(dtype).to(device) for _ in "qk")
    return qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, norms


def check_rope_and_store(impl, device: str, dtypes=DTYPES, interpreted: bool = False) -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype in dtypes:
        for case in ROPE_CASES:
            n, heads, kv_heads, head_dim, qk_norm, ghosts, scaling, strided = case
            what = f"rope_and_store {dtype} {case}"
            qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, (q_norm, k_norm) = rope_inputs(
                *case, dtype, device, gen)
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            untouched = k_cache.clone(), v_cache.clone()
            q = impl.rope_and_store(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, heads, kv_heads,
                                    head_dim, q_norm, k_norm, 1e-6)
            q_ref = ops_torch.rope_and_store(qkv, positions, inv_freq, k_ref, v_ref, slot_mapping, heads,
                                               kv_heads, head_dim, q_norm, k_norm, 1e-6)
            ulps, differing = allowed_ulps(dtype, interpreted), allowed_differing(dtype, interpreted)
            assert_ulps(q, q_ref, ulps, pair_scale(q_ref), what=f"{what} q", max_differing=differing)
            assert_ulps(k_cache, k_ref, ulps, pair_scale(k_ref), what=f"{what} k_cache", max_differing=differing)
            assert torch.equal(v_cache, v_ref), f"{what}: v_cache differs"
            written = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=device)
            written[slot_mapping[slot_mapping >= 0]] = True
            assert torch.equal(k_cache[~written], untouched[0][~written]), f"{what}: a ghost row wrote k"
            assert torch.equal(v_cache[~written], untouched[1][~written]), f"{what}: a ghost row wrote v"


def tiny_built(arch: str, hidden: int, scaling: dict | None, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A tiny model rebuilt with ``scaling`` and ``dtype`` as a loader builds it, its norm weights made
    random (``tiny_model`` sets them to 1, which would hide a wrong weight multiply)."""
    loaded = tiny_model(seed=7, arch=arch, hidden=hidden)
    cfg = ModelConfig(**{**loaded.config.to_dict(), "rope_scaling": scaling})
    gen = torch.Generator().manual_seed(8)
    state = {name: 1 + 0.2 * torch.randn(w.shape, generator=gen) if name.endswith("norm.weight") else w
             for name, w in loaded.model.state_dict().items()}
    return build_model(cfg, state, dtype)


def two_steps(model: CausalLM) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """(input_ids, positions, metadata) of two passes: a prefill of two sequences (5 and 3 tokens, at
    positions in the thousands so that rotary angles are large), then a decode of one token each."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=gen)
    prefill = (ids[:8], torch.tensor([1000, 1001, 1002, 1003, 1004, 3000, 3001, 3002]),
               build_metadata([[0, 1, 2, 3, 4], [8, 9, 10]], [5, 3]))
    decode = (ids[8:], torch.tensor([1005, 3003]), build_metadata([[0, 1, 2, 3, 4, 5], [8, 9, 10, 11]], [1, 1]))
    return [prefill, decode]


def fused_forward(ops, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  meta: AttentionMetadata) -> torch.Tensor:
    """``CausalLM.forward`` rebuilt on the fused ops: the residual add moves into the next norm.

    The projections stay separate and are concatenated, so that the fused qkv and gate_up inputs hold
    exactly the eager values (a fused GEMM may sum in another order); what is tested is the ops.
    """
    cfg = model.config
    x = model.model.embed_tokens(input_ids)
    inv_freq = model.rotary.inv_freq
    residual = None
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h, residual = ops.rms_norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps, residual)
        qkv = torch.cat((attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)), dim=-1)
        k_cache, v_cache = cache.layer(i)
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        q = ops.rope_and_store(qkv, positions, inv_freq, k_cache, v_cache, meta.slot_mapping, cfg.num_heads,
                               cfg.num_kv_heads, cfg.head_dim, *norms, cfg.rms_norm_eps)
        out = paged_attention(q, k_cache, v_cache, meta, attn.scale)
        h, residual = ops.rms_norm(attn.o_proj(out.reshape(len(input_ids), -1)),
                                   layer.post_attention_layernorm.weight, cfg.rms_norm_eps, residual)
        x = mlp.down_proj(ops.silu_mul(torch.cat((mlp.gate_proj(h), mlp.up_proj(h)), dim=-1)))
    return ops.rms_norm(x, model.model.norm.weight, cfg.rms_norm_eps, residual)[0]
