"""The avx2 tier's row read plan (bf16 streams, prefetch distances): measured once per CPU and kept, forced by
its variable, checked, and without effect on what a GEMM computes."""
import json

import pytest
import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels import stream_tune
from saguaro.backends.cpu_kernels.kept import cpu_identity

needs_avx2 = pytest.mark.skipif("avx2" not in kernels.runnable_tiers(), reason="this CPU lacks AVX2")


@pytest.fixture
def ops():
    ops = kernels.load("avx2")
    before = ops.row_reads()
    yield ops
    ops.set_row_reads(*before)


@needs_avx2
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(256, 192), (512, 320)], ids=["odd-tiles", "five-tiles"])
def test_the_plan_changes_nothing_a_gemm_computes(ops, shape, weights):
    k, n = shape
    w, x = torch.randn(n, k).bfloat16(), torch.randn(1, k).bfloat16()
    if weights == "bf16":
        packed = torch.empty(n // 64, k // 2, 64, 2, dtype=torch.bfloat16)
        ops.pack(packed, [w], 0)
    elif weights == "int8":
        packed = torch.empty(n // 64, k // 4 + 4, 64, 4, dtype=torch.uint8)
        ops.pack_i8(packed, [w], 0)
    else:
        packed = torch.empty(n // 64, k // 32, ops.I4_BLOCK, dtype=torch.uint8)
        ops.pack_i4(packed, [w], 0)
    # a row's bits do not depend on how many rows share the call (AR against SD's verification): three rows
    # take the multi-row kernels, which no plan touches
    rows = ops.gemm(torch.cat([x, torch.randn(2, k).bfloat16()]), packed, n, None, None, 0, False)
    plans = [(s, b, q) for s, b in stream_tune.BF16_CANDIDATES for q in stream_tune.QUANT_CANDIDATES]
    outs = []
    for plan in plans:
        ops.set_row_reads(*plan)
        assert tuple(ops.row_reads()) == plan
        outs.append(ops.gemm(x, packed, n, None, None, 0, False))
    assert all(torch.equal(rows[:1], o) for o in outs)
    reference = x.float() @ w.float().T  # int4 codes carry ~11% of a weight's spread as rounding error
    assert (outs[0].float() - reference).norm() / reference.norm() < {"bf16": 0.02, "int8": 0.03, "int4": 0.2}[weights]
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.set_row_reads(1, 100, 0)
    with pytest.raises(RuntimeError, match="0 to 8 blocks"):
        ops.set_row_reads(1, 0, 9)
    with pytest.raises(RuntimeError, match="1 or 2 streams"):
        ops.set_row_reads(3, 0, 0)


@needs_avx2
def test_measured_once_per_cpu_then_kept(ops, monkeypatch, tmp_path):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    monkeypatch.delenv(stream_tune.ENV, raising=False)
    monkeypatch.setattr(stream_tune, "measure", lambda ops: (2, 256, 1))
    assert stream_tune.apply(ops) == (2, 256, 1) and tuple(ops.row_reads()) == (2, 256, 1)
    kept = json.loads((tmp_path / "cpu" / "row_reads.json").read_text())
    assert kept == {f"{cpu_identity()} | avx2": [2, 256, 1]}

    def no_second_probe(ops):
        raise AssertionError("measured again")
    monkeypatch.setattr(stream_tune, "measure", no_second_probe)
    ops.set_row_reads(1, 0, 0)
    assert stream_tune.apply(ops) == (2, 256, 1) and tuple(ops.row_reads()) == (2, 256, 1)
    monkeypatch.setenv(stream_tune.ENV, "1:512:0")  # the variable wins over what was kept
    assert stream_tune.apply(ops) == (1, 512, 0) and tuple(ops.row_reads()) == (1, 512, 0)


@needs_avx2
def test_info_names_the_plan(ops, monkeypatch):
    from saguaro.info import read_plan
    monkeypatch.setenv(stream_tune.ENV, "2:256:1")
    stream_tune.apply(ops)
    assert read_plan("avx2").startswith("avx2 row reads: 2 bf16 stream(s), 256 bytes prefetched ahead; int8/int4 1 "
                                        "block(s) ahead")
    assert read_plan("portable") is None and read_plan("avx512") is None


@pytest.mark.parametrize("text", ["2", "1:0", "3:0:0", "1:100:0", "1:0:9", "a:b:c", "1:-64:0", "1:0:-1", "1:0:0:0"])
def test_a_bad_forced_plan_is_named(text):
    with pytest.raises(ValueError, match=stream_tune.ENV):
        stream_tune.parse(text)


@needs_avx2
def test_the_probe_picks_a_candidate(ops):
    streams, bf16, blocks = stream_tune.measure(ops, rounds=1)
    assert (streams, bf16) in stream_tune.BF16_CANDIDATES and blocks in stream_tune.QUANT_CANDIDATES


def test_a_vm_s_cpu_is_told_apart_by_family_and_model():
    zen3 = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t: avx2\n"
    zen4 = "model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\n"
    assert cpu_identity(zen3) == "AMD EPYC family 25 model 1"
    assert cpu_identity(zen3) != cpu_identity(zen4)
