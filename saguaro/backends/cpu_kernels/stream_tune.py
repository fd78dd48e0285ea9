"""How the avx2 tier reads one row's weights, measured once per CPU.

A 1-row GEMM (every decode step) reads each weight once, so its speed is how fast one core streams memory, and
the fastest way to stream differs between cores (1 x 1536 by 1536 x 8960, one core):

  * Zen 3 kept more reads in flight over **two streams** (tile t beside tile t + T/2, each chunk in two passes)
    with 512 bytes of software prefetch ahead of each: ~97% of its 19 GB/s bus against ~87% for one stream;
  * on Zen 4 (33 GB/s) that prefetch cut the rate to 17 GB/s, and the two-pass chunks left even its prefetchers
    at ~25 GB/s, while **one stream** (each tile in turn, one pass) keeps up with the bus.

So the read plan is a run-time setting (``ops.set_row_reads``): the bf16 stream count, the bytes of software
prefetch ahead of each bf16 stream, and the k blocks ahead of each int8 / int4 stream (quantized rows are always
two streams, each block read in address order; the int4 probe sets the distance for both). It is chosen here
by a probe: 1-row GEMMs over packed copies that do not fit the caches, under each candidate in turn, the
fastest kept. It takes about two seconds and runs once per CPU model; the result is kept in
``<cache root>/cpu/row_reads.json``. The plan changes only how fast the weights arrive, never what is computed.

``SAGUARO_ROW_READS=<bf16 streams>:<bf16 bytes>:<quantized blocks>`` sets it outright (e.g. ``1:0:0``: one bf16
stream and the hardware prefetchers alone).
"""
from __future__ import annotations

import logging
import os
import time
from types import ModuleType

import torch

from saguaro.backends.cpu_kernels import kept
from saguaro.backends.cpu_kernels.kept import cpu_identity
from saguaro.backends.cpu_kernels.layout import packed_copies

log = logging.getLogger("saguaro.kernels")
ENV = "SAGUARO_ROW_READS"
FILE = "row_reads.json"
Plan = tuple[int, int, int]  # (bf16 streams, bytes ahead of each bf16 stream, k blocks ahead of a quantized one)
BF16_CANDIDATES = ((1, 0), (1, 512), (2, 0), (2, 256), (2, 512))  # (streams, bytes ahead)
QUANT_CANDIDATES = (0, 1, 2)  # k blocks ahead (int4: 1,280 bytes each, int8: 2,048)
K, N, COPIES = 1536, 4096, 8  # 8 bf16 copies of 12.6 MB: 100 MB, past any L3 one core reads


def parse(text: str) -> Plan:
    """``"2:512:2"`` -> (2, 512, 2); a clear error otherwise."""
    try:
        plan = tuple(int(v) for v in text.strip().split(":"))
    except ValueError:
        plan = ()
    if len(plan) != 3 or plan[0] not in (1, 2) or plan[1] < 0 or plan[1] % 64 or not 0 <= plan[2] <= 8:
        raise ValueError(f"{ENV}={text!r}: expected <bf16 streams (1 or 2)>:<bf16 bytes (a multiple of 64)>:"
                         f"<quantized blocks (0 to 8)>, e.g. 1:0:0 or 2:512:2")
    return plan


def apply(ops: ModuleType) -> Plan:
    """Set the avx2 tier's read plan on ``ops`` (other tiers ignore it); returns it."""
    if ops.TIER != "avx2":
        return tuple(ops.row_reads())
    forced = os.environ.get(ENV, "").strip()
    if forced:
        plan = parse(forced)
    else:
        key = f"{cpu_identity()} | {ops.TIER}"

        def measured() -> Plan:
            plan = measure(ops)
            log.info("avx2 row reads for %s: %d bf16 stream(s), %d bytes ahead of bf16, %d blocks ahead of int8 / "
                     "int4 (measured)", key, *plan)
            return plan
        plan = kept.once(FILE, key, _plan, measured, list)
    ops.set_row_reads(*plan)
    return plan


def measure(ops: ModuleType, rounds: int = 3) -> Plan:
    """The bf16 and the int4 candidates whose GEMMs stream fastest (the best of ``rounds`` passes over every
    copy), each timed under the other's default."""
    w, x = torch.randn(N, K).bfloat16(), torch.randn(1, K).bfloat16()
    bf16 = _fastest(ops, w, x, "bf16", [(*c, 2) for c in BF16_CANDIDATES], rounds)
    return _fastest(ops, w, x, "int4", [(*bf16[:2], c) for c in QUANT_CANDIDATES], rounds)


def _fastest(ops: ModuleType, w: torch.Tensor, x: torch.Tensor, weights: str, plans: list[Plan],
             rounds: int) -> Plan:
    packed = packed_copies(ops, w, weights, COPIES * N * K * 2)  # as many bytes as 8 bf16 copies, either format
    best = {plan: float("inf") for plan in plans}
    for _ in range(rounds):
        for plan in plans:  # interleaved, so that a burst of load falls on every candidate alike
            ops.set_row_reads(*plan)
            start = time.perf_counter()
            for p in packed:
                ops.gemm(x, p, N, None, None, 0, False)
            best[plan] = min(best[plan], time.perf_counter() - start)
    return min(plans, key=lambda plan: best[plan])


def _plan(value) -> Plan | None:
    """A kept plan, or None if it is missing or malformed (then measured again)."""
    try:
        return int(value[0]), int(value[1]), int(value[2])
    except (TypeError, ValueError, IndexError, KeyError):
        return None
