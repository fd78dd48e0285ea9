"""What a GEMM over n rows costs against one row, per weight format, measured once per CPU and kernel tier.

One row (a decode step) reads every weight once and waits on the bus; more rows (a verification of K + 1
tokens, a build step over its branches, a batch) reuse each weight from registers, and the kernels turn
compute-bound at a row count that depends on the format and the tier: on a Zen 4 core with avx512, bf16 stays
near 1.0x up to 6 rows, while int4 costs 1.3x at 3 rows and 2x at 5 (two vpdpbusd per 8 weights and row, and
the per-block scales); the avx2 bf16 kernel, two FMAs per weight and row, is at 1.7-2.0x by 4 rows. A planner
that takes an extra row for nearly free (the documented defaults: 2%) speculates far too deep with an int4
target. So without a calibration profile the default costs take their row curves from this probe
(``calibration.pair_cost``).

The probe times GEMMs of 1536 x 4096 over packed copies that do not fit the caches, every row count of
``rows`` once per round (interleaved, so a burst of load falls on all), the least of three rounds kept, made
monotone. About a second per format; kept in ``<cache root>/cpu/row_costs.json`` per CPU model, tier, kernel
source and format, so that every later run of the same kernels (and a seeded request's K, which reads only
these) sees the same curve, and changed kernels are measured again.
"""
from __future__ import annotations

import logging
import time
from types import ModuleType

import torch

from saguaro.backends.cpu_kernels import build, kept
from saguaro.backends.cpu_kernels.kept import cpu_identity
from saguaro.backends.cpu_kernels.layout import packed_copies

log = logging.getLogger("saguaro.kernels")
K, N = 1536, 4096
COPIES_BYTES = 100 << 20  # past any L3 one core reads, in either format
FILE = "row_costs.json"
Curve = dict[int, float]  # rows -> a GEMM over that many rows / over one row


def curve(ops: ModuleType, weights: str, rows: tuple[int, ...]) -> Curve:
    """The kept curve of ``weights`` on ``ops``' tier for this CPU, measured first if any of ``rows`` is new."""
    key = curve_key(ops, weights)

    def covering(value) -> Curve | None:
        known = _curve(value)
        return known if set(rows) <= set(known) else None

    def measured() -> Curve:
        known = measure(ops, weights, tuple(sorted(set(rows) | set(_curve(kept.read(FILE).get(key))))))
        log.info("GEMM row costs for %s (measured): %s", key, ", ".join(f"{n} rows {c:.2f}x" for n, c in known.items()))
        return known

    known = kept.once(FILE, key, covering, measured, lambda c: {str(n): v for n, v in c.items()})
    return {n: known[n] for n in rows}


def curve_key(ops: ModuleType, weights: str) -> str:
    """Where a curve is kept: this CPU model, ``ops``' tier, the kernels' sources and the weight format."""
    return f"{cpu_identity()} | {ops.TIER} | {build.source_digest()} | {weights}"


def measure(ops: ModuleType, weights: str, rows: tuple[int, ...], rounds: int = 3, n: int = N, k: int = K,
            copies_bytes: int = COPIES_BYTES) -> Curve:
    """[m rows -> seconds over m rows / seconds over one row] of an [n, k] GEMM; each the least time measured at
    >= m rows (as ``calibration.measure.monotone``: a burst of load inflates single measurements)."""
    counts = sorted(set(rows) | {1})
    w = torch.randn(n, k).bfloat16()
    xs = {m: torch.randn(m, k).bfloat16() for m in counts}
    packed = packed_copies(ops, w, weights, copies_bytes)
    best = {m: float("inf") for m in counts}
    for _ in range(rounds):
        for m in counts:
            start = time.perf_counter()
            for p in packed:
                ops.gemm(xs[m], p, n, None, None, 0, False)
            best[m] = min(best[m], time.perf_counter() - start)
    for m, more in zip(counts[-2::-1], counts[:0:-1]):  # more rows never cost less: the least time at >= m rows
        best[m] = min(best[m], best[more])
    return {m: best[m] / best[1] for m in rows}


def _curve(value) -> Curve:
    """A kept curve ({} if missing or malformed: then measured again)."""
    try:
        return {int(n): float(c) for n, c in value.items()}
    except (AttributeError, TypeError, ValueError):
        return {}
