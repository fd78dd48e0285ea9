"""Backends: how a model runs its forward passes on a device (the seam is ``backends/base.py``).

``make_backend`` picks the fastest exact path the device supports unless told otherwise:
CUDA -> ``paged`` (fused ops, CUDA graphs); a bf16 model on a CPU -> ``cpu_kernels`` (its best kernel tier);
anything else, and ``enforce_eager`` -> ``eager``, the reference.
"""
from __future__ import annotations

import logging

import torch

from saguaro.backends.base import Backend
from saguaro.backends.batch import ForwardItem, TreeRows
from saguaro.models.transformer import CausalLM

log = logging.getLogger("saguaro.backends")
KINDS = ("auto", "eager", "cpu_kernels", "paged")

__all__ = ["Backend", "ForwardItem", "TreeRows", "KINDS", "choose_kind", "make_backend"]


def make_backend(model: CausalLM, cache, device: torch.device, enforce_eager: bool, weights: str = "bf16",
                 head_ids: torch.Tensor | None = None, kind: str = "auto", graphs: bool = True,
                 max_table_blocks: int | None = None) -> Backend:
    """The backend for ``model`` on ``device``.

    ``enforce_eager``: the eager reference (CPU draft formats excepted, which exist only
    as CPU kernels). ``kind`` forces a backend (tests run ``paged`` on the CPU, with torch reference ops and
    CUDA graphs replaced by their eager stand-in). ``max_table_blocks`` is the widest block table a CUDA
    graph must hold."""
    from saguaro.backends.dense import DenseBackend
    if kind not in KINDS:
        raise ValueError(f"backend must be one of {KINDS}, got {kind!r}")
    custom = weights != "bf16" or head_ids is not None
    if kind == "auto":
        kind = choose_kind(model, device, enforce_eager, custom)
    if custom and kind != "cpu_kernels":
        raise ValueError("int8 / int4 draft weights and a reduced draft head run on the CPU kernels only")
    if kind == "eager":
        return DenseBackend(model, device, "eager")
    if kind == "cpu_kernels":
        from saguaro.backends.cpu_kernels.model import fast_or_eager
        net = fast_or_eager(model, weights, head_ids)
        return DenseBackend(net, device, "cpu_kernels" if net is not model else "eager")
    return _paged(model, cache, device, graphs, max_table_blocks)


def choose_kind(model: CausalLM, device: torch.device, enforce_eager: bool, custom: bool = False) -> str:
    """The default backend: the fastest exact path ``device`` supports, or the eager reference when
    ``enforce_eager``. ``custom`` draft weights exist only as CPU kernels."""
    if device.type == "cuda" and not enforce_eager:
        return "paged"
    if custom or (not enforce_eager and _cpu_kernels_apply(model)):
        return "cpu_kernels"
    return "eager"


def _paged(model: CausalLM, cache, device: torch.device, graphs: bool, max_table_blocks: int | None) -> Backend:
    from saguaro.backends.paged.graphs import CudaCapture, EagerCapture, GraphRunner
    from saguaro.backends.paged.backend import PagedBackend
    from saguaro.backends.paged.model import PagedCausalLM, ops_for
    net = PagedCausalLM(model, ops_for(device))
    runner = None
    if graphs:
        capture = CudaCapture(device) if device.type == "cuda" else EagerCapture()
        widest = max_table_blocks or cache.num_blocks
        runner = GraphRunner(net, cache, device, capture, widest)
    return PagedBackend(net, device, runner)


def _cpu_kernels_apply(model: CausalLM) -> bool:
    """Whether the bf16 CPU kernels can run ``model`` here; when they cannot, the default quietly stays eager
    (an fp32 model, one on a GPU, an unsupported head size), and the reason is logged at debug level."""
    from saguaro.backends.cpu_kernels.model import unsupported_reason
    reason = unsupported_reason(model)
    if reason:
        log.debug("bf16 CPU kernels off: %s", reason)
    return reason is None
