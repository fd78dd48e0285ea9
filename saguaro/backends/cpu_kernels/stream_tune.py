"""How the avx2 tier reads one bf16 row's weights, measured once per CPU.

A 1-row bf16 GEMM (every decode step of a bf16 model) reads each weight once, so its speed is how fast one core
streams memory, and the fastest way to stream differs between cores (1 x 1536 by 1536 x 8960, one core):

  * Zen 3 kept more reads in flight over **two streams** (tile t beside tile t + T/2, each chunk in two passes)
    with 512 bytes of software prefetch ahead of each: ~97% of its 19 GB/s bus against ~87% for one stream;
  * on Zen 4 (31 GB/s) that prefetch cut the rate to 17 GB/s, and the two-pass chunks left even its prefetchers
    at ~25 GB/s, while **one stream** (each tile in turn, one pass) keeps up with the bus.

So the read plan, a stream count and a prefetch distance, is a run-time setting (``ops.set_bf16_reads``),
chosen here by a probe: a 1-row GEMM over packed copies that do not fit the caches, under each candidate plan in
turn, the fastest kept. It takes about a second and runs once per CPU model; the result is kept in
``<cache root>/cpu/bf16_reads.json``. The plan changes only how fast the weights arrive, never what is computed.

``SAGUARO_BF16_READS=<streams>:<bytes>`` sets it outright (e.g. ``1:0``, one stream and the hardware prefetchers
alone).
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
ENV = "SAGUARO_BF16_READS"
# (streams, bytes of prefetch ahead of each)
CANDIDATES = ((1, 0), (1, 512), (2, 0), (2, 256), (2, 512))
K, N, COPIES = 1536, 4096, 8  # 8 copies of 12.6 MB: 100 MB, past any L3 one core reads


def parse(text: str) -> tuple[int, int]:
    """``"2:512"`` -> (2, 512); a clear error otherwise."""
    streams, sep, distance = text.strip().partition(":")
    try:
        plan = (int(streams), int(distance))
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected <streams>:<bytes>, e.g. 1:0 or 2:512") from None
    if not sep or plan[0] not in (1, 2) or plan[1] < 0 or plan[1] % 64:
        raise ValueError(f"{ENV}={text!r}: streams must be 1 or 2, bytes a non-negative multiple of 64")
    return plan


def apply(ops: ModuleType) -> tuple[int, int]:
    """Set the avx2 tier's bf16 read plan on ``ops`` (other tiers ignore it); returns (streams, bytes)."""
    if ops.TIER != "avx2":
        return tuple(ops.bf16_reads())
    forced = os.environ.get(ENV, "").strip()
    if forced:
        plan = parse(forced)
    else:
        path, key = cache_root() / "cpu" / "bf16_reads.json", f"{cpu_identity()} | {ops.TIER}"
        known = _read(path)
        if key not in known:
            known[key] = measure(ops)
            log.info("avx2 bf16 reads for %s: %d stream(s), %d bytes ahead (measured)", key, *known[key])
            _write(path, {**_read(path), key: known[key]})
        plan = known[key]
    ops.set_bf16_reads(*plan)
    return plan


def measure(ops: ModuleType, rounds: int = 3) -> tuple[int, int]:
    """The candidate plan whose GEMM streams fastest (the best of ``rounds`` passes over every copy)."""
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
            ops.set_bf16_reads(*c)
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


def _read(path) -> dict[str, tuple[int, int]]:
    try:
        return {k: (int(v[0]), int(v[1])) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError, IndexError, KeyError):
        return {}


def _write(path, values: dict[str, tuple[int, int]]) -> None:
    """Atomically: two processes measuring at once each leave a whole file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({k: list(v) for k, v in values.items()}, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measured again next time
        log.warning("could not keep the bf16 read plan in %s: %s", path, e)
