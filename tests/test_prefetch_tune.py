"""The avx2 tier's bf16 prefetch distance: measured once per CPU and kept, forced by its variable, checked, and
without effect on what a GEMM computes."""
import json

import pytest
import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels import prefetch_tune

needs_avx2 = pytest.mark.skipif("avx2" not in kernels.runnable_tiers(), reason="this CPU lacks AVX2")


@pytest.fixture
def ops():
    ops = kernels.load("avx2")
    before = ops.prefetch_bf16()
    yield ops
    ops.set_prefetch_bf16(before)


@needs_avx2
def test_the_distance_changes_nothing_a_gemm_computes(ops):
    k, n = 256, 192
    w, x = torch.randn(n, k).bfloat16(), torch.randn(1, k).bfloat16()
    packed = torch.empty(n // 64, k // 2, 64, 2, dtype=torch.bfloat16)
    ops.pack(packed, [w], 0)
    outs = []
    for distance in prefetch_tune.CANDIDATES:
        ops.set_prefetch_bf16(distance)
        outs.append(ops.gemm(x, packed, n, None, None, 0, False))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    reference = x.float() @ w.float().T
    torch.testing.assert_close(outs[0].float(), reference, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.set_prefetch_bf16(100)


@needs_avx2
def test_measured_once_per_cpu_then_kept(ops, monkeypatch, tmp_path):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    monkeypatch.delenv(prefetch_tune.ENV, raising=False)
    monkeypatch.setattr(prefetch_tune, "measure", lambda ops: 256)
    assert prefetch_tune.apply(ops) == 256 and ops.prefetch_bf16() == 256
    kept = json.loads((tmp_path / "cpu" / "prefetch.json").read_text())
    assert kept == {f"{prefetch_tune.cpu_identity()} | avx2": 256}

    def no_second_probe(ops):
        raise AssertionError("measured again")
    monkeypatch.setattr(prefetch_tune, "measure", no_second_probe)
    ops.set_prefetch_bf16(0)
    assert prefetch_tune.apply(ops) == 256 and ops.prefetch_bf16() == 256
    monkeypatch.setenv(prefetch_tune.ENV, "512")  # the variable wins over what was kept
    assert prefetch_tune.apply(ops) == 512 and ops.prefetch_bf16() == 512


@needs_avx2
def test_the_probe_picks_a_candidate(ops):
    assert prefetch_tune.measure(ops, rounds=1) in prefetch_tune.CANDIDATES


def test_a_vm_s_cpu_is_told_apart_by_family_and_model():
    zen3 = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t: avx2\n"
    zen4 = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\n"
    assert prefetch_tune.cpu_identity(zen3) == "AMD EPYC family 25 model 1"
    assert prefetch_tune.cpu_identity(zen3) != prefetch_tune.cpu_identity(zen4)
