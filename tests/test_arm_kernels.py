"""The portable kernel tier run on aarch64, not only compiled for it: tests/arm/kernel_harness.cpp (the tier's
GEMM tiles for bf16, int8 and int4 weights, activation quantization, attention (the one kernel of every pass,
as in the extension) and RMSNorm) is built natively and, cross-compiled statically
with Debian's aarch64 toolchain, run under qemu-aarch64 on the same inputs.

The bf16 products, the activation quantization, attention and RMSNorm must be bit-identical on both: the same
IEEE fp32 operations in the same order. The int8 and int4 products' per-block sums are not: GCC contracts
``acc += dot * a`` into fused multiply-adds where the target has them (aarch64), as C++ lets it by default, so
each build must agree with the exact product within fp32 summation's bound instead ((blocks + 3) roundings of
2^-24 of the sum of the terms' magnitudes). The native harness is itself checked against the eager reference,
and a perturbed output and a perturbed input are caught (negative controls).

Skips where the cross compiler or qemu is missing (scripts/setup.sh installs g++-aarch64-linux-gnu and
qemu-user-static when run as root).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.kv.metadata import build_metadata
from saguaro.models.transformer import paged_attention

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "arm" / "kernel_harness.cpp"
CROSS = "aarch64-linux-gnu-g++"
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
GEMMS = {"decode row": (1, 256, 2), "rows and k chunks": (7, 2112, 2)}  # (M, K, tiles): K > 2048 splits k
BIT_EXACT = {"gemm": ("bf16.bin", "xq.bin", "xscale.bin"), "attention": ("attn.bin",), "norm": ("norm.bin",)}
U = 2.0 ** -24  # fp32's unit roundoff


def _build(compiler: str, out: Path, *extra: str) -> Path:
    """The harness with the portable tier's own flags (build.compile_flags), as the extension is built."""
    flags = [f for f in kernels.compile_flags("portable") if not f.startswith("-mtune")]
    result = subprocess.run([compiler, "-std=c++17", *flags, f"-I{HERE / 'arm'}", f"-I{kernels.CSRC}", "-o", str(out),
                             str(SOURCE), *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> list[str]:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the harness")
    return [str(_build("g++", tmp_path_factory.mktemp("native") / "harness"))]


@pytest.fixture(scope="module")
def arm(tmp_path_factory) -> list[str]:
    if shutil.which(CROSS) is None:
        pytest.skip(f"no aarch64 cross compiler ({CROSS}; Debian: g++-aarch64-linux-gnu, see scripts/setup.sh)")
    if QEMU is None:
        pytest.skip("no qemu-aarch64 user-mode emulator (Debian: qemu-user-static, see scripts/setup.sh)")
    return [QEMU, str(_build(CROSS, tmp_path_factory.mktemp("arm") / "harness", "-static"))]


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.bfloat16().view(torch.int16).numpy()


def _gemm_case(path: Path, M: int, K: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    """x and one weight in each packed layout: bf16 [T, K/2, 64, 2]; int8 codes [T, K/4, 64, 4], then 64 fp32
    scales in 4 more rows of 256 bytes; int4 code groups, fp16 scales and offsets per 32 k (csrc/quant_pack.h).
    The codes are arbitrary bytes."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    x, w = torch.randn(M, K, generator=g).bfloat16(), (torch.randn(64 * T, K, generator=g) * 0.05).bfloat16()
    _bf16(x).tofile(path / "x.bin")
    _bf16(w).reshape(T, 64, K // 2, 2).transpose(0, 2, 1, 3).tofile(path / "w_bf16.bin")
    scales = np.zeros((T, 4, 64, 4), np.uint8)
    scales[:, 0] = rng.uniform(1e-3, 1e-2, (T, 64)).astype(np.float32).view(np.uint8).reshape(T, 64, 4)
    np.concatenate((rng.integers(0, 256, (T, K // 4, 64, 4), dtype=np.uint8), scales), 1).tofile(path / "w_i8.bin")
    s_z = np.concatenate((rng.uniform(1e-3, 1e-2, (T, K // 32, 64)), rng.uniform(-0.05, 0, (T, K // 32, 64))), 2)
    codes = rng.integers(0, 256, (T, K // 32, 1024), dtype=np.uint8)
    np.concatenate((codes, s_z.astype(np.float16).view(np.uint8)), 2).tofile(path / "w_i4.bin")
    return {"x": x, "w": w}


def _chunk(cached: int, new: int, first: int) -> tuple[list[int], torch.Tensor]:
    slots = [first + 3 * i + (i % 5) for i in range(cached + new)]  # scattered, as cache blocks are
    return slots, torch.ones(new, cached + new, dtype=torch.bool).tril(cached)


def _attention_case(path: Path, seed: int) -> tuple[list[str], dict]:
    """A 40-token chunk after 70 (key blocks of 64 crossed), a decode token, a short chunk and tree branches (a
    mask read from its bytes), in one call, grouped heads."""
    H, KVH, D = 9, 3, 64
    tree = torch.zeros(5, 65, dtype=torch.bool)
    tree[:, :60] = True
    tree[torch.arange(5), 60 + torch.arange(5)] = True
    groups = [_chunk(70, 40, 0), (list(range(1000, 1077)), torch.ones(1, 77, dtype=torch.bool)),
              _chunk(0, 15, 2000), (list(range(4000, 4065)), tree), _chunk(130, 20, 5000)]
    g = torch.Generator().manual_seed(seed)
    slots = 1 + max(max(c) for c, _ in groups)
    k, v = (torch.randn(2, slots, KVH, D, generator=g) * 2).bfloat16()
    meta = build_metadata([c for c, _ in groups], [m.shape[0] for _, m in groups], [m for _, m in groups])
    n = sum(m.shape[0] for _, m in groups)
    q = torch.randn(n, H, D, generator=g).bfloat16()
    qkv = torch.cat((q.view(n, -1), torch.zeros(n, 2 * KVH * D, dtype=torch.bfloat16)), 1)
    for name, t in (("qkv", qkv), ("k", k), ("v", v)):
        _bf16(t).tofile(path / f"{name}.bin")
    for name, t in (("qi", meta.query_index), ("ctx", meta.context_slots), ("qv", meta.query_valid),
                    ("mask", meta.mask)):
        t.contiguous().numpy().tofile(path / f"{name}.bin")
    S, Q = meta.query_index.shape
    args = [str(a) for a in (n, H, KVH, D, S, Q, meta.context_slots.shape[1], D ** -0.5)]
    return args, {"q": q, "k": k, "v": v, "meta": meta}


def _norm_case(path: Path, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    _bf16(torch.randn(5, 576, generator=g) * 3).tofile(path / "x.bin")
    _bf16(1 + 0.1 * torch.randn(576, generator=g)).tofile(path / "w.bin")
    return ["5", "576", "1e-05"]


def _run(harness: list[str], op: str, case: Path, out: Path, args: list[str]) -> Path:
    out.mkdir(exist_ok=True)
    result = subprocess.run([*harness, op, str(case), str(out), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def _mismatch(op: str, a: Path, b: Path) -> str | None:
    """The first output file whose bytes differ between runs a and b, with where, or None."""
    for name in BIT_EXACT[op]:
        x, y = np.fromfile(a / name, np.uint8), np.fromfile(b / name, np.uint8)
        if x.shape != y.shape or not np.array_equal(x, y):
            where = np.flatnonzero(x != y) if x.shape == y.shape else "size"
            return f"{name} differs (bytes {where[:8] if x.shape == y.shape else where})"
    return None


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[str, Path, list[str], dict]]:
    """name: (op, input directory, harness arguments, the tensors behind the inputs)."""
    made = {}
    for i, (name, (M, K, T)) in enumerate(GEMMS.items()):
        path = tmp_path_factory.mktemp("gemm")
        made[f"gemm, {name}"] = ("gemm", path, [str(M), str(K), str(T)], _gemm_case(path, M, K, T, seed=i))
    path = tmp_path_factory.mktemp("attention")
    args, tensors = _attention_case(path, seed=7)
    made["attention, tiled and masked"] = ("attention", path, args, tensors)
    path = tmp_path_factory.mktemp("norm")
    made["rms norm"] = ("norm", path, _norm_case(path, seed=3), {})
    return made


def _quantized_products(case: Path, out: Path, M: int, K: int, T: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The int8 and int4 products in float64 from the quantized rows the harness wrote (checked against numpy's
    quantization) and the packed codes, each with its bound: {file: (exact [M, 64 T], bound)}."""
    nb, N = K // 32, 64 * T
    xq = np.fromfile(out / "xq.bin", np.int8).astype(np.int64).reshape(M, nb, 32)
    a = np.fromfile(out / "xscale.bin", np.float32).astype(np.float64).reshape(M, nb, 1)
    w8 = np.fromfile(case / "w_i8.bin", np.uint8).reshape(T, K // 4 + 4, 64, 4)
    codes = (w8[:, :K // 4].transpose(0, 2, 1, 3).reshape(N, nb, 32).astype(np.int64) - 128)
    scale = w8[:, K // 4].reshape(T, 256).view(np.float32).reshape(N).astype(np.float64)
    terms = np.einsum("mbk,nbk->mnb", xq, codes) * a.transpose(0, 2, 1)  # [M, N, nb]: a dot per block
    found = {"i8.bin": (terms.sum(2) * scale, (nb + 3) * U * np.abs(terms).sum(2) * np.abs(scale))}
    w4 = np.fromfile(case / "w_i4.bin", np.uint8).reshape(T, nb, 1280)
    packed = w4[:, :, :1024].reshape(T, nb, 4, 64, 4)  # [t, b, g, j, i]: k = 8g + i (low), 8g + 4 + i (high)
    q4 = np.concatenate((packed & 15, packed >> 4), 4).transpose(0, 3, 1, 2, 4).reshape(N, nb, 32).astype(np.int64)
    s_z = w4[:, :, 1024:].copy().view(np.float16).astype(np.float64).reshape(T, nb, 2, 64)
    s, z = (s_z[:, :, i].transpose(0, 2, 1).reshape(N, nb) for i in (0, 1))
    d, qsum = np.einsum("mbk,nbk->mnb", xq, q4), xq.sum(2)[:, None, :]
    a = a.transpose(0, 2, 1)
    found["i4.bin"] = ((a * (s * d + z * qsum)).sum(2), (nb + 3) * U * (a * (np.abs(s * d) + np.abs(z * qsum))).sum(2))
    return found


def _within_bounds(case: Path, out: Path, args: list[str]) -> str | None:
    """The first quantized product outside its bound, or None; quantization itself as numpy rounds it."""
    M, K, T = (int(a) for a in args)
    x = np.fromfile(case / "x.bin", np.uint16).astype(np.uint32) << 16
    v = x.view(np.float32).reshape(M, K // 32, 32)
    amax = np.abs(v).max(2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    if not np.array_equal(np.rint(v * inv).astype(np.int8).ravel(), np.fromfile(out / "xq.bin", np.int8)):
        return "xq.bin is not numpy's quantization"
    for name, (exact, bound) in _quantized_products(case, out, M, K, T).items():
        got = np.fromfile(out / name, np.float32).astype(np.float64).reshape(exact.shape)
        if not (np.abs(got - exact) <= bound).all():
            return f"{name}: {np.sum(np.abs(got - exact) > bound)} outputs outside the bound"
    return None


def test_aarch64_matches_x86(native, arm, cases, tmp_path):
    for name, (op, path, args, _) in cases.items():
        here = _run(native, op, path, tmp_path / f"{name}-x86", args)
        there = _run(arm, op, path, tmp_path / f"{name}-arm", args)
        assert _mismatch(op, here, there) is None, f"{name}: {_mismatch(op, here, there)}"
        if op == "gemm":
            assert _within_bounds(path, there, args) is None, f"{name} on aarch64: {_within_bounds(path, there, args)}"


def test_the_harness_matches_the_eager_reference(native, cases, tmp_path):
    """bf16 products within fp32 summation's bound (K roundings of at most 2^-24 of sum |x w| each), the
    quantized ones within theirs; attention as tests/test_attention_tiled.py bounds it."""
    for name, (op, path, args, t) in cases.items():
        out = _run(native, op, path, tmp_path / name.replace(" ", "_").replace(",", ""), args)
        if op == "gemm":
            x, w = t["x"].double(), t["w"].double()
            got = torch.from_numpy(np.fromfile(out / "bf16.bin", np.float32).reshape(x.shape[0], -1)).double()
            bound = x.shape[1] * U * (x.abs() @ w.abs().T)
            assert ((got - x @ w.T).abs() <= bound).all(), name
            assert _within_bounds(path, out, args) is None, f"{name}: {_within_bounds(path, out, args)}"
        elif op == "attention":
            q, meta = t["q"], t["meta"]
            ref = paged_attention(q.float(), t["k"].float(), t["v"].float(), meta, q.shape[-1] ** -0.5)
            got = torch.from_numpy(np.fromfile(out / "attn.bin", np.int16)).view(torch.bfloat16).float()
            torch.testing.assert_close(got.view_as(ref), ref, rtol=0.02, atol=0.02)


def test_a_perturbed_output_or_input_is_caught(native, cases, tmp_path):
    op, path, args, _ = cases["attention, tiled and masked"]
    here = _run(native, op, path, tmp_path / "x86", args)
    again = _run(native, op, path, tmp_path / "again", args)
    assert _mismatch(op, here, again) is None  # the harness is deterministic
    attn = np.fromfile(again / "attn.bin", np.uint16)
    attn[attn.size // 2] ^= 1  # one bf16 ulp of one output
    attn.tofile(again / "attn.bin")
    assert "attn.bin differs" in (_mismatch(op, here, again) or "")
    op, path, args, _ = cases["gemm, rows and k chunks"]
    changed = tmp_path / "changed"
    shutil.copytree(path, changed)
    x = np.fromfile(changed / "x.bin", np.uint16)
    x[5] ^= 1  # one ulp of one activation
    x.tofile(changed / "x.bin")
    assert "bf16.bin differs" in (_mismatch(op, _run(native, op, path, tmp_path / "g1", args),
                                            _run(native, op, changed, tmp_path / "g2", args)) or "")


@pytest.mark.parametrize("weights, byte", [("w_i8.bin", 1000), ("w_i4.bin", 1000)])
def test_the_quantized_bound_catches_a_changed_code(native, cases, tmp_path, weights, byte):
    """One weight code one step off (an int8 code, or an int4 low nibble) is outside the bound, so the bound
    admits rounding only."""
    op, path, args, _ = cases["gemm, rows and k chunks"]
    changed = tmp_path / "changed"
    shutil.copytree(path, changed)
    w = np.fromfile(changed / weights, np.uint8)
    w[byte] ^= 1
    w.tofile(changed / weights)
    out = _run(native, op, changed, tmp_path / "out", args)
    found = _within_bounds(path, out, args)
    assert found is not None and found.startswith(weights[2:]), found
