"""The avx2 tier's software prefetch distance for bf16 weights, measured once per CPU.

The avx2 bf16 loop reads each weight once, as two streams, and can ask for the lines ahead of them. Whether that
helps depends on the core: one Zen 3 core kept more reads in flight with 512 bytes ahead, while on Zen 4 the
same distance cut the rate to 17 GB/s from 26 without it (1 x 1536 by 1536 x 8960, one core). So the distance is
a run-time setting (``ops.set_prefetch_bf16``), chosen here by a probe: a 1-row GEMM over packed copies that do
not fit the caches, at each candidate distance in turn, the fastest kept. It takes about half a second and runs
once per CPU model; the result is kept in ``<cache root>/cpu/prefetch.json``. The distance changes only how fast
the weights arrive, never what is computed.

``SAGUARO_PREFETCH_BF16=<bytes>`` sets it outright (0: the hardware prefetchers alone).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from types import ModuleType

import torch

from saguaro.loading.paths import cache_root

log = logging.getLogger("saguaro.kernels")
ENV = "SAGUARO_PREFETCH_BF16"
CANDIDATES = (0, 256, 512)  # bytes ahead of each stream
K, N, COPIES = 1536, 4096, 8  # 8 copies of 12.6 MB: 100 MB, past any L3 one core reads


def apply(ops: ModuleType) -> int:
    """Set the avx2 tier's bf16 prefetch distance on ``ops`` (other tiers ignore it); returns it."""
    if ops.TIER != "avx2":
        return int(ops.prefetch_bf16())
    forced = os.environ.get(ENV, "").strip()
    if forced:
        ops.set_prefetch_bf16(int(forced))
        return int(forced)
    path, key = cache_root() / "cpu" / "prefetch.json", f"{cpu_identity()} | {ops.TIER}"
    known = _read(path)
    if key not in known:
        known[key] = measure(ops)
        log.info("avx2 bf16 prefetch distance for %s: %d bytes (measured)", key, known[key])
        _write(path, {**_read(path), key: known[key]})
    ops.set_prefetch_bf16(int(known[key]))
    return int(known[key])


def measure(ops: ModuleType, rounds: int = 3) -> int:
    """The candidate distance whose GEMM streams fastest (the best of ``rounds`` passes over every copy)."""
    size = N * K * 2
    arena = ops.alloc_huge(size * COPIES)
    packed = [arena[i * size:(i + 1) * size].view(torch.bfloat16).view(-1, K // 2, 64, 2) for i in range(COPIES)]
    w = torch.randn(N, K).bfloat16()
    for p in packed:
        ops.pack(p, [w], 0)
    x = torch.randn(1, K).bfloat16()
    best = {c: float("inf") for c in CANDIDATES}
    for _ in range(rounds):
        for c in CANDIDATES:  # interleaved, so that a burst of load falls on every candidate alike
            ops.set_prefetch_bf16(c)
            start = time.perf_counter()
            for p in packed:
                ops.gemm(x, p, N, None, None, 0, False)
            best[c] = min(best[c], time.perf_counter() - start)
    return min(CANDIDATES, key=lambda c: best[c])


def cpu_identity(cpuinfo: str | None = None) -> str:
    """The CPU's name with its family and model: a VM may show every AMD core as "AMD EPYC"."""
    if cpuinfo is None:
        try:
            cpuinfo = open("/proc/cpuinfo").read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() not in fields:
            fields[name.strip()] = value.strip()
    return " ".join(filter(None, [fields.get("model name") or fields.get("Model") or platform.machine(),
                                  fields.get("cpu family") and f"family {fields['cpu family']}",
                                  fields.get("model") and f"model {fields['model']}"]))


def _read(path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _write(path, values: dict[str, int]) -> None:
    """Atomically: two processes measuring at once each leave a whole file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(values, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measured again next time
        log.warning("could not keep the prefetch distance in %s: %s", path, e)
