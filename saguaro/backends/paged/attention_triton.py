"""Per-row paged attention as a Triton kernel: the GPU fast path, capturable in a CUDA graph.

Same contract as ``attention_torch.py`` (shapes in ``attention_rows.py``). How it runs:

* **One program per (query row, kv head, split).** The program loads the G query heads that share
  the kv head, so under GQA each K/V tile is read once for all of them, and walks its positions in
  tiles of ``TILE``: a prefix position's slot comes from the block table, an extra position's
  from ``extra_slots``. K and V are loaded straight from the cache (no dense copy), and softmax is
  online in float32 (running max and sum, FlashAttention style).
* **Split-K (flash-decoding).** A batch-1 decode has only KVH = 2 programs per layer for Qwen2.5,
  which would leave all but two SMs idle. So each row's positions are cut into ``splits`` slices,
  one program each, and ``combine_kernel`` merges the partial softmaxes. ``splits`` is chosen from
  shapes only (rows, kv heads, the block table's capacity, the SM count), never from lengths, and
  each program sizes its slice from the lengths it reads itself: so the grid is fixed and a
  captured graph replays correctly when the lengths change.
* **Graph capture.** No host sync, no ``.item()``, no data-dependent allocation or grid; the
  partial buffers have shape-only sizes. Launch once before capturing (Triton compiles on first use).
  Lengths are *not* validated here (that would sync): a prefix past the block table reads garbage.

fp32 inputs use IEEE dot products (no TF32), so fp32 results match the torch reference tightly;
bf16/fp16 inputs multiply in their dtype with float32 accumulation (probabilities are rounded to
the input dtype before P @ V, as in FlashAttention).

The module imports without triton and without CUDA; ``triton`` is imported when a kernel launches.
To run the kernel on CPU tensors, set ``TRITON_INTERPRET=1`` before triton is first imported.
"""
from __future__ import annotations

import functools
import threading

import torch

from saguaro.backends.paged.attention_rows import check_paged_args

_lane = threading.local()  # sm_count: the SMs this thread's kernels run on (``lane_sm_count``)
LOG2_E = 1.4426950408889634
MAX_SPLITS = 64
MIN_SPLIT_POSITIONS = 64  # fewer positions per program than this and the combine costs more than it saves
CPU_SM_COUNT = 8  # stand-in SM count under TRITON_INTERPRET, so CPU tests see several splits


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, row_group: torch.Tensor, prefix_len: torch.Tensor,
                           extra_slots: torch.Tensor, extra_len: torch.Tensor, block_size: int, scale: float,
                           out: torch.Tensor | None = None, *, num_splits: int | None = None) -> torch.Tensor:
    """Attention of every query row over its paged prefix and its extra slots. Shapes: ``attention_rows.py``.

    ``num_splits`` overrides ``choose_splits`` (tests and benchmarks); it must stay fixed for a captured graph.
    """
    check_paged_args(q, k_cache, v_cache, block_tables, row_group, prefix_len, extra_slots, extra_len,
                     block_size, out)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("extra_slots", extra_slots)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    if out is None:
        out = torch.empty_like(q)
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if n == 0:
        return out
    splits = num_splits or default_splits(q, k_cache, block_tables, extra_slots, block_size)
    split_kernel, combine_kernel, interpret = _kernels(q.device)
    split_constants, combine_constants = kernel_constants(q.dtype, heads, kv_heads, dim, block_size, splits,
                                                          interpret)
    # E = 0 leaves extra_slots empty; any valid pointer will do, since no lane reads it then
    extras = extra_slots if extra_slots.numel() else prefix_len
    if splits == 1:
        part_acc = part_max = part_sum = out  # unused when DIRECT
    else:
        part_acc = torch.empty(n, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    split_kernel[(n, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, row_group, prefix_len, extras, extra_len,
        out, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), extra_slots.stride(0), out.stride(0), out.stride(1),
        scale * LOG2_E, dim, **split_constants)
    if splits > 1:
        combine_kernel[(n, heads)](part_acc, part_max, part_sum, out, out.stride(0), out.stride(1), dim,
                                   **combine_constants)
    return out


def kernel_constants(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int, splits: int,
                     interpret: bool) -> tuple[dict, dict]:
    """Compile-time arguments (and warps) of split_kernel and combine_kernel for these shapes.

    Under the interpreter the tiles are small, so that CPU tests at short contexts still cross tile
    and split boundaries (the online rescaling and the combine).
    """
    dim_pad = max(16, triton_next_pow2(dim))  # tl.dot wants every side >= 16
    group = heads // kv_heads
    split = dict(GROUP=group, GROUP_PAD=max(16, triton_next_pow2(group)), DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
                 TILE=16 if interpret else 64 if dim_pad <= 128 else 32, SPLITS=splits, DIRECT=splits == 1,
                 DOT_F32=interpret and dtype != torch.float32,
                 PRECISION="ieee" if dtype == torch.float32 else "tf32",  # tf32: ignored by 16-bit dots
                 num_warps=4)
    combine = dict(SPLITS=splits, SPLITS_PAD=triton_next_pow2(splits), DIM_PAD=dim_pad, num_warps=4)
    return split, combine


def choose_splits(rows: int, kv_heads: int, capacity: int, sm_count: int) -> int:
    """Splits per (row, kv head): enough programs for about one per SM, from shapes only.

    ``capacity`` is the most positions a row can see (block table width * block_size + E); it caps
    the splits so that a full-length row still gives each split ``MIN_SPLIT_POSITIONS``. A shorter row
    just leaves its last splits empty (they exit at once), which is why lengths never enter here.
    """
    programs = rows * kv_heads
    if programs >= sm_count:
        return 1
    wanted = -(-sm_count // programs)
    return max(1, min(wanted, capacity // MIN_SPLIT_POSITIONS, MAX_SPLITS))


def default_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, extra_slots: torch.Tensor,
                   block_size: int) -> int:
    """The splits ``paged_attention_triton`` launches with for these shapes on q's device (on the SMs of this
    thread's lane, where ``lane_sm_count`` confined it to a share of them)."""
    capacity = block_tables.shape[1] * block_size + extra_slots.shape[1]
    sms = getattr(_lane, "sm_count", None) or _sm_count(q.device)
    return choose_splits(q.shape[0], k_cache.shape[1], capacity, sms)


def lane_sm_count(sms: int | None) -> None:
    """The SMs this thread's kernels run on (a green context's share), or None for the whole device. Per thread:
    the speculator's lane sets it before it captures its graphs, so their split counts fit its share."""
    _lane.sm_count = sms


def triton_next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernels(device: torch.device) -> tuple:
    """(split_kernel, combine_kernel, interpreted?), importing triton on first use (see attention_kernels.py)."""
    try:
        import triton
    except ImportError as e:  # triton ships Linux wheels only
        raise RuntimeError("paged_attention_triton needs triton (pip install triton==3.6.0)") from e
    from triton.runtime.interpreter import InterpretedFunction

    from saguaro.backends.paged import attention_kernels

    interpreted = isinstance(attention_kernels.split_kernel, InterpretedFunction)
    library_interpreted = isinstance(triton.language.max, InterpretedFunction)  # decorated at triton's import
    if not interpreted == library_interpreted == bool(triton.knobs.runtime.interpret):
        raise RuntimeError("TRITON_INTERPRET changed after triton was imported; set it before the first import")
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(f"paged_attention_triton runs on CUDA tensors, or on CPU ones under TRITON_INTERPRET=1; "
                           f"got {device}")
    return attention_kernels.split_kernel, attention_kernels.combine_kernel, interpreted
