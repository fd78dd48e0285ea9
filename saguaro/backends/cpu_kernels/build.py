"""Builds and loads the bf16 CPU kernels (``cpu_bf16.cpp``) on first use.

The kernels need AVX512-BF16, and AVX512-VNNI for the int8/int4 draft GEMMs (AMD Zen 4, Intel
Sapphire Rapids and later). They are compiled with ``-march=native`` by
``torch.utils.cpp_extension`` the first time they are asked for (about a minute on a 2-core
machine) and cached under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); torch rebuilds them
when the source changes and serialises concurrent builds with a file lock, so later
processes load them in well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

from saguaro.models.draft_format import WEIGHT_FORMATS  # noqa: F401  (re-exported: how a matrix can be packed)

log = logging.getLogger("saguaro.kernels")
CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "cpu_bf16.cpp"
HEADERS = [CSRC / "quant_gemm.h"]  # #included by SOURCE


class KernelsUnavailable(RuntimeError):
    """The fast kernels cannot run here (CPU without AVX512-BF16, or no C++ compiler)."""


def cpu_supports_bf16() -> bool:
    """Whether this CPU executes AVX512-BF16 and AVX512-VNNI (Linux: read from /proc/cpuinfo)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512_bf16", "avx512bw", "avx512_vnni"))  # vnni: int8 and int4 draft weights


@functools.cache
def load() -> ModuleType:
    """The compiled kernel module; raises ``KernelsUnavailable`` if it cannot be had."""
    if not cpu_supports_bf16():
        raise KernelsUnavailable("this CPU lacks AVX512-BF16; the fast bf16 path needs it")
    from torch.utils.cpp_extension import load as build
    # torch rebuilds when the sources or flags change, but does not read #included headers: their
    # hash goes into the flags
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    try:
        return build(name="saguaro_cpu_bf16", sources=[str(SOURCE)],
                     extra_cflags=["-O3", "-march=native", "-fno-math-errno", f"-DSAGUARO_HEADERS={headers}"],
                     verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, failed build
        raise KernelsUnavailable(f"could not build {SOURCE.name}: {e}") from e


def available() -> bool:
    try:
        load()
        return True
    except KernelsUnavailable as e:
        log.warning("%s", e)
        return False
