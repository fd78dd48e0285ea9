"""The Triton kernels under Triton's interpreter, on CPU tensors (not a test file).

Run as ``TRITON_INTERPRET=1 python -m tests.ops_interpreted CHECK`` by ``tests/test_ops_fused.py``, in a
process of its own: the interpreter is chosen when the kernels are decorated, at import (see there).
CHECK is one of rms_norm, silu_mul, rope_and_store, forward, capture. Exits non-zero on the first mismatch.
"""
from __future__ import annotations

import os
import sys

import torch

from saguaro.kv.kv_cache import KVCache
from tests import fused_cases


@torch.no_grad()
def check_forward(ops) -> None:
    """Two-layer passes through the interpreted kernels stay within rounding of eager: float32, and
    float16 (the dtype the interpreter rounds to nearest, as a GPU does), where they agree to an ulp."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        for arch, hidden, scaling in (("qwen3", 256, fused_cases.LLAMA3_SCALING), ("qwen2", 64, None)):
            model = fused_cases.tiny_built(arch, hidden, scaling, dtype)
            eager_cache, fused_cache = (KVCache(model.config, 4, 4, dtype) for _ in range(2))
            for ids, positions, meta in fused_cases.two_steps(model):
                expected = model(ids, positions, eager_cache, meta)
                actual = fused_cases.fused_forward(ops, model, ids, positions, fused_cache, meta)
                scale = float(expected.abs().max())
                torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)
                torch.testing.assert_close(fused_cache.data, eager_cache.data, rtol=tol, atol=tol)


@torch.no_grad()
def check_capture(ops) -> None:
    """The paged model on the Triton ops (fused ops and attention) captures under ``CaptureChecker``: causal
    graphs and SSD tree-step graphs (extra slots), the wrappers' Python included. Only the interpreter's
    emulation of each launch runs unchecked (it reads the arguments on the host; a GPU launch does not)."""
    from triton.runtime.interpreter import InterpretedFunction
    from saguaro.backends.paged.attention_triton import paged_attention_triton
    from saguaro.backends.paged.capture_check import unchecked
    from saguaro.backends.paged.graphs import EagerCapture, GraphRunner
    from saguaro.backends.paged.model import PagedCausalLM, PagedOps
    real_run = InterpretedFunction.run

    def run(self, *args, **kwargs):
        with unchecked():
            return real_run(self, *args, **kwargs)
    InterpretedFunction.run = run
    model = fused_cases.tiny_built("qwen3", 64, None, torch.float32)
    cache = KVCache(model.config, 8, 4, torch.float32)
    triton_ops = PagedOps("triton", ops.rms_norm, ops.rope_and_store, ops.silu_mul, paged_attention_triton)
    runner = GraphRunner(PagedCausalLM(model, triton_ops), cache, torch.device("cpu"), EagerCapture(), 4)
    runner.capture_all(max_rows=4, extras=(0, 2))
    assert set(runner.graphs) == {(b, e) for b in (1, 2, 4) for e in (0, 2)}


def main(check: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the kernels take CPU tensors only in Triton's interpreter")
    from saguaro.backends.paged import ops_triton
    if check == "forward":
        check_forward(ops_triton)
    elif check == "capture":
        check_capture(ops_triton)
    else:
        getattr(fused_cases, f"check_{check}")(ops_triton, "cpu", interpreted=True)


if __name__ == "__main__":
    main(sys.argv[1])
