"""What a CUDA graph forbids, enforced on the CPU: a mode that raises on every host sync or data-dependent shape.

A CUDA graph records kernels, not Python: while one is captured, reading a device value on the host (``.item()``,
``.tolist()``, ``.cpu()``, ``int(t)``, ``if t:``) fails or silently bakes in the captured value, and an op whose
output shape depends on values (``nonzero``, a boolean-mask index, ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``) must sync to size its output. On a GPU these surface only at
capture, on the GPU machine. ``CaptureChecker`` makes them fail on the CPU too: ``EagerCapture`` (the CPU
stand-in for a capture, ``graphs.py``) runs the step under it, so the engine's tests on the paged backend check
every pass shape they capture (AR, SD and SSD tree steps).

Two layers, because on the CPU some host reads never reach the dispatcher (``.cpu()`` of a CPU tensor is
the tensor itself): a ``TorchFunctionMode`` sees the Python-level calls, a ``TorchDispatchMode`` the aten ops.
Both are per thread, like a capture with ``capture_error_mode="thread_local"``.

``capturing()`` says whether this thread is inside a capture (CUDA's or the checker's): value checks that
read the host (argument validation) skip themselves there, since a graph cannot run them anyway.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_state = threading.local()
aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """An op that a CUDA-graph capture cannot hold: it reads the device on the host or sizes its output by values."""


_HOST_READS = {  # Python-level calls that read a tensor's values on the host
    torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()",
    # what the dispatcher does not always see: under inference mode int(t) reads without a dispatched op
    torch.Tensor.__int__: "int(t)", torch.Tensor.__float__: "float(t)", torch.Tensor.__bool__: "bool(t)",
    torch.Tensor.__index__: "a tensor used as an index",
}
_SYNCING_OPS = {  # aten ops that read values on the host or size their output by them
    aten._local_scalar_dense.default: "a tensor read to the host (.item(), int(t), float(t), bool(t), if t)",
    aten.equal.default: "torch.equal (a host bool)",
    aten.is_nonzero.default: "a tensor's truth value read to the host",
    aten.nonzero.default: "nonzero (data-dependent shape)",
    aten.argwhere.default: "argwhere (data-dependent shape)",
    aten.masked_select.default: "masked_select (data-dependent shape)",
    aten._unique.default: "unique (data-dependent shape)",
    aten._unique2.default: "unique (data-dependent shape)",
    aten.unique_dim.default: "unique (data-dependent shape)",
    aten.unique_consecutive.default: "unique_consecutive (data-dependent shape)",
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def capturing() -> bool:
    """Whether this thread is capturing a graph: a CUDA capture on its current stream, or the CPU checker."""
    if getattr(_state, "depth", 0):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names the CPU as its target device."""
    targets = [a for a in args[1:] if isinstance(a, (str, torch.device))] + [kwargs.get("device")]
    return any(t is not None and torch.device(t).type == "cpu" for t in targets)


class _FunctionLayer(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _HOST_READS.get(func)
        if what is None and func is torch.Tensor.to and _to_host(args, kwargs):
            what = ".to('cpu')"
        if what is not None:
            raise HostSyncError(f"{what} inside a CUDA-graph capture")
        return func(*args, **kwargs)


class _DispatchLayer(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _SYNCING_OPS.get(func)
        if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            what = "repeat_interleave without output_size (data-dependent shape)"
        if func in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype == torch.bool for t in indices):
                what = "a boolean-mask index (data-dependent shape)"
        if what is not None:
            raise HostSyncError(f"{what} inside a CUDA-graph capture ({func})")
        return func(*args, **kwargs)


class CaptureChecker:
    """``with CaptureChecker():`` -- raise ``HostSyncError`` on whatever a CUDA-graph capture could not hold."""

    def __enter__(self) -> "CaptureChecker":
        _state.depth = getattr(_state, "depth", 0) + 1
        self._outer, _state.checker = getattr(_state, "checker", None), self
        self._push()
        return self

    def __exit__(self, *exc) -> None:
        self._pop()
        _state.checker = self._outer
        _state.depth -= 1

    def _push(self) -> None:
        self._modes = (_FunctionLayer(), _DispatchLayer())
        for mode in self._modes:
            mode.__enter__()

    def _pop(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)


@contextmanager
def unchecked() -> Iterator[None]:
    """The body runs outside this thread's checker. For what stands in for a launch on the CPU only: Triton's
    interpreter copies a kernel's arguments to the host to emulate it, where a real launch reads nothing."""
    checker = getattr(_state, "checker", None)
    if checker is None:
        yield
        return
    checker._pop()
    try:
        yield
    finally:
        checker._push()
