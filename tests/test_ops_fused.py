"""Fused ops (``backends/paged/ops_*.py``): the torch references equal the eager model bitwise, the Triton kernels
equal the references (under Triton's interpreter on the CPU, compiled on a GPU), and each kernel
survives CUDA-graph capture and replay with new inputs.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.models.model_config import ModelConfig
from saguaro.models.rope import apply_rotary
from saguaro.models.transformer import MLP, RMSNorm
from saguaro.backends.paged import ops_torch
from tests import fused_cases
from tests.fused_cases import LLAMA3_SCALING, fused_forward, tiny_built, two_steps

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch,hidden,scaling", [("qwen2", 64, None), ("qwen3", 256, None),
                                                 ("llama", 64, LLAMA3_SCALING)],
                         ids=["qwen2-bias", "qwen3-qknorm-d64", "llama3-scaling"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_reference_forward_equals_eager_bitwise(arch, hidden, scaling, dtype):
    # the references repeat eager's ops one for one, so they agree in every dtype, not just float32
    model = tiny_built(arch, hidden, scaling, dtype)
    eager_cache, fused_cache = (KVCache(model.config, 4, 4, dtype) for _ in range(2))
    for ids, positions, meta in two_steps(model):
        expected = model(ids, positions, eager_cache, meta)
        assert torch.equal(fused_forward(ops_torch, model, ids, positions, fused_cache, meta), expected)
        assert torch.equal(fused_cache.data, eager_cache.data)


@torch.no_grad()
def test_reference_ops_equal_eager_modules_bitwise():
    # each op against the module it replaces, on odd shapes where torch's CPU kernels mix vector and scalar paths
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(96, 1e-6)
    norm.weight.normal_(1, 0.2, generator=gen)
    x, residual = torch.randn(37, 96, generator=gen), torch.randn(37, 96, generator=gen)
    y, s = ops_torch.rms_norm(x, norm.weight, 1e-6, residual)
    assert torch.equal(s, residual + x) and torch.equal(y, norm(residual + x))

    model = tiny_built("qwen3", 64, LLAMA3_SCALING)
    cfg = model.config
    mlp = MLP(ModelConfig(**{**cfg.to_dict(), "hidden_size": 24, "intermediate_size": 37}))
    h = torch.randn(37, 24, generator=gen)
    gate_up = torch.cat((mlp.gate_proj(h), mlp.up_proj(h)), dim=-1)
    assert torch.equal(mlp.down_proj(ops_torch.silu_mul(gate_up)), mlp(h))

    attn = model.model.layers[0].self_attn
    attn.q_norm.weight.normal_(1, 0.2, generator=gen)
    attn.k_norm.weight.normal_(1, 0.2, generator=gen)
    h = torch.randn(37, cfg.hidden_size, generator=gen)
    positions = torch.randint(0, 20000, (37,), generator=gen)
    cos, sin = model.rotary(positions, torch.float32)
    ref_cos, ref_sin = ops_torch.rope_cos_sin(positions, model.rotary.inv_freq, torch.float32)
    assert torch.equal(ref_cos, cos) and torch.equal(ref_sin, sin)
    slots = torch.randperm(64, generator=gen)[:37]
    eager_kv = [torch.zeros(64, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    fused_kv = [torch.zeros(64, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    attn(h, cos, sin, eager_kv, build_metadata([[int(s)] for s in slots], [1] * 37))  # each token alone
    qkv = torch.cat((attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)), dim=-1)
    q = ops_torch.rope_and_store(qkv, positions, model.rotary.inv_freq, *fused_kv, slots, cfg.num_heads,
                                   cfg.num_kv_heads, cfg.head_dim, attn.q_norm.weight, attn.k_norm.weight,
                                   cfg.rms_norm_eps)
    assert torch.equal(fused_kv[0], eager_kv[0]) and torch.equal(fused_kv[1], eager_kv[1])
    q_eager = attn.q_norm(attn.q_proj(h).view(37, cfg.num_heads, cfg.head_dim))
    assert torch.equal(q, apply_rotary(q_eager, cos, sin))


def test_reference_ghost_rows_write_nothing():
    k_cache, v_cache = torch.full((4, 1, 4), 7.0), torch.full((4, 1, 4), 7.0)
    qkv = torch.randn(3, 12)
    q = ops_torch.rope_and_store(qkv, torch.tensor([0, 1, 2]), torch.ones(2), k_cache, v_cache,
                                   torch.tensor([-1, 2, -1]), 1, 1, 4)
    assert q.shape == (3, 1, 4)
    assert torch.equal(v_cache[2, 0], qkv[1, 8:])
    assert (v_cache[[0, 1, 3]] == 7).all() and (k_cache[[0, 1, 3]] == 7).all()


def test_reference_refuses_half_qk_norm():
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        ops_torch.rope_and_store(torch.randn(1, 12), torch.zeros(1, dtype=torch.long), torch.ones(2),
                                   torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, dtype=torch.long),
                                   1, 1, 4, q_norm=torch.ones(4))


# Triton's interpreter is chosen when a kernel is decorated (at import of saguaro.backends.paged.ops_triton) from
# TRITON_INTERPRET, so setting the variable inside this process would do nothing once any test has
# imported the module compiled, and would turn every later import into interpreted kernels. Each
# interpreted check therefore runs in a fresh process (tests/ops_interpreted.py) with the variable set.
@pytest.mark.parametrize("check", ["rms_norm", "silu_mul", "rope_and_store", "forward", "capture"])
def test_triton_matches_reference_in_interpreter(check):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    run = subprocess.run([sys.executable, "-m", "tests.ops_interpreted", check], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_triton_refuses_bad_input():
    from saguaro.backends.paged import ops_triton
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="contiguous rows"):
        ops_triton.rms_norm(x.t(), torch.ones(2), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops_triton.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="odd number"):
        ops_triton.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="columns"):
        ops_triton.rope_and_store(torch.randn(1, 12), torch.zeros(1, dtype=torch.long), torch.ones(2),
                                    torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, dtype=torch.long),
                                    2, 1, 4)
    with pytest.raises(ValueError, match="k_cache"):
        ops_triton.rope_and_store(torch.randn(1, 12), torch.zeros(1, dtype=torch.long), torch.ones(2),
                                    torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, dtype=torch.long),
                                    1, 1, 4)


def _signature(dtype: str, **pointers_and_scalars: str) -> dict[str, str]:
    return {name: kind.replace("T", dtype) for name, kind in pointers_and_scalars.items()}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_triton_kernels_compile_for_hopper_without_a_gpu(dtype):
    # the interpreter runs Python, so it accepts code that the compiler refuses (libdevice calls only exist
    # compiled): compile each variant ahead of time for sm_90 with the ptxas bundled in Triton's wheel
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime import JITFunction
    from saguaro.backends.paged import ops_triton
    if not isinstance(ops_triton._rms_norm_kernel, JITFunction):
        pytest.skip("the kernels were imported for the interpreter (TRITON_INTERPRET=1)")
    rms = _signature(dtype, x_ptr="*T", res_ptr="*T", w_ptr="*T", y_ptr="*T", s_ptr="*T", x_stride="i32",
                     res_stride="i32", hidden="i32", inv_hidden="fp32", eps="fp32")
    rope = _signature(dtype, qkv_ptr="*T", pos_ptr="*i64", inv_freq_ptr="*fp32", k_cache_ptr="*T",
                      v_cache_ptr="*T", slot_ptr="*i64", q_ptr="*T", q_norm_ptr="*T", k_norm_ptr="*T",
                      qkv_stride="i32", cache_slot_stride="i32", cache_head_stride="i32", eps="fp32")
    silu = _signature(dtype, gate_up_ptr="*T", out_ptr="*T", gate_up_stride="i32", inter="i32")
    variants = [(ops_triton._rms_norm_kernel, rms, {"HAS_RESIDUAL": r, "BLOCK": 2048}) for r in (False, True)]
    variants += [(ops_triton._rope_and_store_kernel, rope,
                  {"NUM_HEADS": 12, "NUM_KV_HEADS": 2, "HALF": 64, "BLOCK_H": 16, "BLOCK_KV": 2, "BLOCK_HALF": 64,
                   "HAS_NORM": norm, "LIBDEVICE": True}) for norm in (False, True)]
    variants.append((ops_triton._silu_mul_kernel, silu, {"BLOCK": 1024, "LIBDEVICE": True}))
    for kernel, signature, constants in variants:
        source = ASTSource(kernel, {**signature, **{name: "constexpr" for name in constants}}, constants)
        compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8, "enable_fp_fusion": False})
        assert compiled.asm["cubin"], f"{kernel.__name__} {constants}: no cubin"


# ---- on a GPU: the compiled kernels (libdevice math, round-to-nearest) and CUDA graphs ----

@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("check", ["rms_norm", "silu_mul", "rope_and_store"])
def test_triton_matches_reference_on_cuda(check):
    from saguaro.backends.paged import ops_triton
    getattr(fused_cases, f"check_{check}")(ops_triton, "cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_reference_forward_equals_eager_bitwise_on_cuda(dtype):
    model = tiny_built("qwen3", 256, LLAMA3_SCALING, dtype).to("cuda")
    eager_cache, fused_cache = (KVCache(model.config, 4, 4, dtype, "cuda") for _ in range(2))
    for ids, positions, meta in two_steps(model):
        ids, positions, meta = ids.cuda(), positions.cuda(), meta.to("cuda")
        expected = model(ids, positions, eager_cache, meta)
        assert torch.equal(fused_forward(ops_torch, model, ids, positions, fused_cache, meta), expected)
        assert torch.equal(fused_cache.data, eager_cache.data)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_triton_forward_close_to_eager_on_cuda(dtype):
    from saguaro.backends.paged import ops_triton
    model = tiny_built("qwen3", 256, LLAMA3_SCALING, dtype).to("cuda")
    eager_cache, fused_cache = (KVCache(model.config, 4, 4, dtype, "cuda") for _ in range(2))
    for ids, positions, meta in two_steps(model):
        ids, positions, meta = ids.cuda(), positions.cuda(), meta.to("cuda")
        expected = model(ids, positions, eager_cache, meta)
        actual = fused_forward(ops_triton, model, ids, positions, fused_cache, meta)
        # a two-layer pass carries an op's rare last-bit difference through the GEMMs: a few ulp of the
        # hidden state's scale (bf16's ulp is 2^-8 relative)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * float(expected.abs().max()))


def _graph_case(op: str, dtype: torch.dtype, gen: torch.Generator):
    """(inputs, run(ops, inputs) -> outputs) for one op; rope_and_store's outputs include both caches."""
    if op == "rms_norm":
        inputs = [torch.randn(shape, generator=gen).to(dtype).cuda() for shape in ((8, 1536), (8, 1536))]
        inputs.append((1 + 0.2 * torch.randn(1536, generator=gen)).to(dtype).cuda())
        return inputs, lambda ops, x, r, w: ops.rms_norm(x, w, 1e-6, r)
    if op == "silu_mul":
        return [torch.randn(8, 2 * 8960, generator=gen).to(dtype).cuda()], lambda ops, gu: (ops.silu_mul(gu),)
    case = (8, 12, 2, 128, True, True, None, False)
    qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, norms = fused_cases.rope_inputs(*case, dtype, "cuda", gen)

    def run(ops, qkv, positions, slot_mapping, k_cache, v_cache):
        return ops.rope_and_store(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, 12, 2, 128, *norms), \
            k_cache, v_cache
    return [qkv, positions, slot_mapping, k_cache, v_cache], run


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "rope_and_store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_capture_and_replay_in_cuda_graph(op, dtype):
    from saguaro.backends.paged import ops_triton
    gen = torch.Generator().manual_seed(5)
    static, run = _graph_case(op, dtype, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(ops_triton, *static)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run(ops_triton, *static)
    for _ in range(2):  # new values in the same buffers; a replay must read them, not the captured ones
        fresh, _ = _graph_case(op, dtype, gen)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        expected = run(ops_torch, *[t.clone() for t in static])
        graph.replay()
        torch.cuda.synchronize()
        ulps, differing = fused_cases.allowed_ulps(dtype, False), fused_cases.allowed_differing(dtype, False)
        for i, (got, want) in enumerate(zip(outputs, expected)):
            scale = fused_cases.pair_scale(want) if op == "rope_and_store" and i < 2 else None
            fused_cases.assert_ulps(got, want, ulps, scale, what=f"{op} replay output {i}", max_differing=differing)
