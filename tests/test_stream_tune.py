"""The avx2 tier's bf16 read plan (streams, prefetch distance): measured once per CPU and kept, forced by its
variable, checked, and without effect on what a GEMM computes."""
import json

import pytest
import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels import stream_tune

needs_avx2 = pytest.mark.skipif("avx2" not in kernels.runnable_tiers(), reason="this CPU lacks AVX2")


@pytest.fixture
def ops():
    ops = kernels.load("avx2")
    before = ops.bf16_reads()
    yield ops
    ops.set_bf16_reads(*before)


@needs_avx2
@pytest.mark.parametrize("shape", [(256, 192), (512, 320)], ids=["odd-tiles", "five-tiles"])
def test_the_plan_changes_nothing_a_gemm_computes(ops, shape):
    k, n = shape
    w, x = torch.randn(n, k).bfloat16(), torch.randn(1, k).bfloat16()
    packed = torch.empty(n // 64, k // 2, 64, 2, dtype=torch.bfloat16)
    ops.pack(packed, [w], 0)
    outs = []
    for plan in stream_tune.CANDIDATES:
        ops.set_bf16_reads(*plan)
        assert tuple(ops.bf16_reads()) == plan
        outs.append(ops.gemm(x, packed, n, None, None, 0, False))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    reference = x.float() @ w.float().T
    torch.testing.assert_close(outs[0].float(), reference, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.set_bf16_reads(1, 100)
    with pytest.raises(RuntimeError, match="1 or 2 streams"):
        ops.set_bf16_reads(3, 0)


@needs_avx2
def test_measured_once_per_cpu_then_kept(ops, monkeypatch, tmp_path):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    monkeypatch.delenv(stream_tune.ENV, raising=False)
    monkeypatch.setattr(stream_tune, "measure", lambda ops: (2, 256))
    assert stream_tune.apply(ops) == (2, 256) and tuple(ops.bf16_reads()) == (2, 256)
    kept = json.loads((tmp_path / "cpu" / "bf16_reads.json").read_text())
    assert kept == {f"{stream_tune.cpu_identity()} | avx2": [2, 256]}

    def no_second_probe(ops):
        raise AssertionError("measured again")
    monkeypatch.setattr(stream_tune, "measure", no_second_probe)
    ops.set_bf16_reads(1, 0)
    assert stream_tune.apply(ops) == (2, 256) and tuple(ops.bf16_reads()) == (2, 256)
    monkeypatch.setenv(stream_tune.ENV, "1:512")  # the variable wins over what was kept
    assert stream_tune.apply(ops) == (1, 512) and tuple(ops.bf16_reads()) == (1, 512)


@pytest.mark.parametrize("text", ["2", "3:0", "1:100", "a:b", "1:-64"])
def test_a_bad_forced_plan_is_named(text):
    with pytest.raises(ValueError, match=stream_tune.ENV):
        stream_tune.parse(text)


@needs_avx2
def test_the_probe_picks_a_candidate(ops):
    assert stream_tune.measure(ops, rounds=1) in stream_tune.CANDIDATES


def test_a_vm_s_cpu_is_told_apart_by_family_and_model():
    zen3 = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t: avx2\n"
    zen4 = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\n"
    assert stream_tune.cpu_identity(zen3) == "AMD EPYC family 25 model 1"
    assert stream_tune.cpu_identity(zen3) != stream_tune.cpu_identity(zen4)
