"""The CPU kernel tiers: which ones a CPU executes, forcing one, their build flags, and that the source builds
for the tiers and architectures this machine cannot run (avx512 on an AVX2 machine, portable on aarch64).

The kernels' results per tier are checked against the eager reference in test_fast_path.py and
test_draft_format.py (the ``cpu_tier`` fixture runs them on every tier this CPU executes).
"""
import shutil
import subprocess
import sysconfig

import pytest
import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels.model import FastCausalLM, pass_bytes
from saguaro.models.model_config import ModelConfig
from saguaro.models.transformer import CausalLM

AVX2 = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}


@pytest.mark.skipif(not kernels.is_x86(), reason="x86 feature sets")
def test_tiers_follow_the_cpu_features():
    assert kernels.missing("avx512", ZEN4) == [] and kernels.missing("avx2", ZEN4) == []
    assert kernels.missing("avx512", AVX2) == ["avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"]
    assert kernels.missing("avx2", AVX2) == [] and kernels.missing("portable", frozenset()) == []
    assert kernels.missing("avx2", AVX2 - {"f16c"}) == ["f16c"]


def test_portable_always_runs_and_the_default_is_the_best():
    tiers = kernels.runnable_tiers()
    assert tiers[-1] == "portable" and tiers == [t for t in kernels.TIERS if t in tiers]
    assert kernels.best_tier() == tiers[0]


def test_forcing_a_tier(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "portable")
    assert kernels.chosen_tier() == "portable" and "forced" in kernels.why("portable")
    monkeypatch.setenv(kernels.ENV, "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        kernels.chosen_tier()
    lacking = [t for t in kernels.TIERS if t not in kernels.runnable_tiers()]
    if lacking:  # a tier this CPU cannot execute is refused, not run into an illegal instruction
        monkeypatch.setenv(kernels.ENV, lacking[0])
        with pytest.raises(kernels.KernelsUnavailable, match="lacks"):
            kernels.chosen_tier()
        with pytest.raises(kernels.KernelsUnavailable, match="lacks"):
            kernels.load(lacking[0])


def test_tier_flags_never_target_the_build_machine():
    """-march=native would let a lower tier built on a newer CPU use instructions its CPUs lack."""
    for tier in kernels.TIERS:
        flags = kernels.compile_flags(tier)
        assert not any(f.startswith("-march") for f in flags) and f"-DSAGUARO_TIER_{tier.upper()}" in flags
    assert not any(f.startswith("-mavx") for f in kernels.compile_flags("portable"))


def test_pass_bytes_is_the_packed_arena(cpu_tier):
    cfg = ModelConfig(arch="qwen2", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64, attention_bias=True)
    model = CausalLM(cfg).eval().requires_grad_(False).to(torch.bfloat16)
    for weights in ("bf16", "int8", "int4"):
        fast = FastCausalLM(model, weights, head_ids=torch.arange(40), tier=cpu_tier)
        assert fast.arena.numel() == pass_bytes(cfg, weights, 40)


def _syntax_check(compiler: str, tier: str) -> subprocess.CompletedProcess:
    from torch.utils.cpp_extension import include_paths
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    flags = [f for f in kernels.compile_flags(tier) if not f.startswith("-mtune")]
    return subprocess.run([compiler, "-std=c++20", "-fsyntax-only", "-w", "-DTORCH_EXTENSION_NAME=check", *flags,
                           *includes, str(kernels.SOURCE)], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64 cross compiler (Debian: g++-aarch64-linux-gnu; scripts/setup.sh installs it)")
def test_portable_tier_compiles_for_aarch64():
    result = _syntax_check("aarch64-linux-gnu-g++", "portable")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not kernels.is_x86() or "avx512" in kernels.runnable_tiers() or shutil.which("g++") is None,
                    reason="an AVX-512 machine builds and runs the avx512 tier itself")
def test_avx512_tier_compiles_where_it_cannot_run():
    result = _syntax_check("g++", "avx512")
    assert result.returncode == 0, result.stderr[-3000:]



@pytest.mark.slow
def test_info_names_the_tier_and_the_floor():
    from saguaro.info import report
    from saguaro.models.draft_format import DraftFormat
    text = report("smollm2-135m", "smollm2-135m", DraftFormat("int4", 1024))
    tier = kernels.chosen_tier()
    assert f"target smollm2-135m: bf16; cpu_kernels/{tier}" in text
    assert f"draft  smollm2-135m: int4, head 1024 of 49152; cpu_kernels/{tier}" in text
    assert "GB per token, floor" in text and "one-core bandwidth" in text
