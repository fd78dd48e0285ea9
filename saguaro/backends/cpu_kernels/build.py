"""Builds and loads the CPU kernels (``csrc/``) for a kernel tier chosen from the CPU's features.

Tiers (one source, ``csrc/kernels.cpp``, compiled once per tier with that tier's instruction-set flags, so a
machine can build and test every tier up to its own):

  * ``avx512``: AVX512-BF16 and AVX512-VNNI (AMD Zen 4, Intel Sapphire Rapids and later): vdpbf16ps and
    vpdpbusd;
  * ``avx2``: AVX2, FMA and F16C (AMD Zen 1-3, Intel Haswell and later): bf16 widened to fp32 + FMA,
    vpmaddubsw for int8/int4;
  * ``portable``: any CPU (aarch64 included): plain C++ the compiler vectorizes for the baseline of its
    architecture.

Every tier reads the same packed formats, so every model and draft setting runs on every CPU; only speed
differs. The default is the best tier the CPU executes; ``SAGUARO_CPU_TIER=avx512|avx2|portable`` forces one
(for tests and benchmarks; forcing one the CPU cannot execute is an error). A tier is built by
``torch.utils.cpp_extension`` the first time it is asked for (about a minute on a 2-core machine) and cached
under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); torch rebuilds it when the source
changes and serialises concurrent builds with a file lock, so later processes load it in well under a second.
How the avx2 tier reads a bf16 row (streams, prefetch) is then set for this CPU (``stream_tune.py``).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

from saguaro.models.draft_format import WEIGHT_FORMATS  # noqa: F401  (re-exported: how a matrix can be packed)

log = logging.getLogger("saguaro.kernels")
CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "kernels.cpp"
TIERS = ("avx512", "avx2", "portable")  # best first
ENV = "SAGUARO_CPU_TIER"
# the /proc/cpuinfo flags a tier executes, and the compiler flags that let it use them
REQUIRED = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"),
            "avx2": ("avx2", "fma", "f16c"), "portable": ()}
ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                        "-mavx2", "-mfma", "-mf16c"],
             "avx2": ["-mavx2", "-mfma", "-mf16c"], "portable": []}


class KernelsUnavailable(RuntimeError):
    """The kernels cannot run here (no C++ compiler, a failed build, or a forced tier this CPU lacks)."""


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo: "flags" on x86, "Features" on arm); empty if unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def missing(tier: str, flags: frozenset[str] | None = None) -> list[str]:
    """The features ``tier`` needs that this CPU (or ``flags``) lacks; empty if it runs here."""
    if tier not in TIERS:
        raise ValueError(f"CPU kernel tier must be one of {TIERS}, got {tier!r}")
    if tier != "portable" and not is_x86():
        return [f"x86-64 (this is {platform.machine()})"]
    have = cpu_flags() if flags is None else flags
    return [f for f in REQUIRED[tier] if f not in have]


def runnable_tiers() -> list[str]:
    """The tiers this CPU executes, best first (``portable`` always)."""
    return [t for t in TIERS if not missing(t)]


def best_tier() -> str:
    return runnable_tiers()[0]


def chosen_tier() -> str:
    """The tier the kernels use: ``$SAGUARO_CPU_TIER`` when set, else the best this CPU executes."""
    forced = os.environ.get(ENV, "").strip()
    if not forced:
        return best_tier()
    if lacking := missing(forced):
        raise KernelsUnavailable(f"{ENV}={forced}: this CPU lacks {', '.join(lacking)}")
    return forced


def why(tier: str) -> str:
    """One line saying why ``tier`` is the one chosen here."""
    if os.environ.get(ENV, "").strip():
        return f"forced by {ENV}"
    better = [f"{t} needs {', '.join(missing(t))}" for t in TIERS[:TIERS.index(tier)]]
    return "; ".join(["the best tier this CPU executes"] + better)


def compile_flags(tier: str) -> list[str]:
    """The compiler flags of ``tier``: its instruction sets only, never -march=native, so a lower tier built on
    a newer CPU runs on the older ones it is meant for (tuning for this CPU is harmless)."""
    tune = ["-mtune=native"] if is_x86() else []
    return ["-O3", "-fno-math-errno", f"-DSAGUARO_TIER_{tier.upper()}", *ISA_FLAGS[tier], *tune]


def load(tier: str | None = None) -> ModuleType:
    """The compiled kernels of ``tier`` (default: ``chosen_tier()``); raises ``KernelsUnavailable`` if they
    cannot be had."""
    return _load(tier or chosen_tier())


@functools.cache
def _load(tier: str) -> ModuleType:
    if lacking := missing(tier):
        raise KernelsUnavailable(f"the {tier} kernels need {', '.join(lacking)}, which this CPU lacks")
    from torch.utils.cpp_extension import load as build
    # torch rebuilds when the sources or flags change, but does not read #included headers: their hash goes
    # into the flags
    try:
        ops = build(name=f"saguaro_cpu_{tier}", sources=[str(SOURCE)],
                    extra_cflags=[*compile_flags(tier), f"-DSAGUARO_HEADERS={source_digest()}"], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, failed build
        raise KernelsUnavailable(f"could not build the {tier} kernels ({SOURCE.name}): {e}") from e
    from saguaro.backends.cpu_kernels import stream_tune
    stream_tune.apply(ops)  # how the avx2 tier reads a bf16 row on this CPU (measured once, then kept)
    return ops


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' sources (kernels.cpp and every header): what they compute, and how fast."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in [SOURCE, *sorted(CSRC.glob("*.h"))])).hexdigest()[:16]


def running_tier() -> str | None:
    """The tier whose kernels load here (``chosen_tier()``'s), None where none can: the engine then runs eager."""
    try:
        return load().TIER
    except KernelsUnavailable:
        return None


def available(tier: str | None = None) -> bool:
    try:
        load(tier)
        return True
    except KernelsUnavailable as e:
        log.warning("%s", e)
        return False
