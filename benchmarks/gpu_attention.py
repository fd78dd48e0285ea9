"""GPU attention per pass: the per-row paged Triton kernel against today's dense eager path (and FlexAttention).

Shape: the Qwen2.5-1.5B attention layer (12 query heads, 2 kv heads, head dim 128), bf16, block
size 16, one sequence whose blocks are scattered through the cache. Passes, at each context:
a 1-row decode, a 5-row verification (K+1 = 5), and SSD tree steps of 8/16/32/64 branch rows
(step 3 of a tree over a K = 4 speculation: each branch sees the prefix up to its fork and its
own 4 scratch tokens, ``saguaro/ssd/tree.py``). One layer's attention only, no projections.

Columns:
* ``triton``: ``paged_attention_triton`` (reads K/V through the block table; ``splits`` from shapes);
* ``dense``: ``paged_attention`` over ``build_metadata`` (gathers the context, SDPA with a [Q, L]
  bool mask), metadata built once outside the timing;
* ``flex``: ``torch.compile``d FlexAttention on a *gathered* layout: the sequence's context copied
  to a dense [1, KVH, L, D] once, outside the timing, with a block mask over the same visibility.
  So it is timed without the gather it would need on the paged cache: a lower bound for it.

Timing: each callable is captured in a CUDA graph and replayed; the figure is the median over
many replays, each bracketed by CUDA events (launch overhead mostly gone, as in the engine's
graphs). Where capture fails the column says so and eager calls are timed instead. ``err`` is
the largest absolute difference from the dense path's output on the same inputs.

    python -m benchmarks.gpu_attention                 # on a GPU machine
    python -m benchmarks.gpu_attention --no-flex --contexts 256,1024
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks.common import fmt, int_list, log, table
from saguaro.backends.paged.attention_triton import paged_attention_triton
from saguaro.backends.paged.attention_triton import default_splits
from saguaro.kv.metadata import AttentionMetadata, build_metadata
from saguaro.models.transformer import paged_attention
from saguaro.ssd.tree import BranchLayout

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 12, 2, 128, 16
CONTEXTS = (256, 1024, 4096)
VERIFY_ROWS = 5
TREE_ROWS = (8, 16, 32, 64)
TREE_K, TREE_STEP = 4, 3


@dataclass
class Pass:
    kind: str  # "decode", "verify" or "tree"
    rows: int
    context: int  # positions of the sequence (the tree's scratch tokens come on top)
    paged: tuple  # the per-row arguments of paged_attention_triton
    q: torch.Tensor  # [rows, H, D]
    meta: AttentionMetadata  # the dense path's metadata, on the device
    visible: torch.Tensor  # [rows, L] bool over the gathered context (the dense mask)
    slots: torch.Tensor  # [L] long: cache slots of the gathered context


def make_pass(kind: str, rows: int, context: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> Pass:
    """One sequence's pass in both forms over one random cache whose blocks are shuffled."""
    scratch_blocks = -(-rows * (TREE_STEP + 1) // BLOCK_SIZE) if kind == "tree" else 0
    blocks = -(-context // BLOCK_SIZE)
    order = torch.randperm(blocks + scratch_blocks + 8, generator=gen)
    k = torch.randn(len(order) * BLOCK_SIZE, KV_HEADS, DIM, generator=gen).to(device, dtype)
    v = torch.randn(len(order) * BLOCK_SIZE, KV_HEADS, DIM, generator=gen).to(device, dtype)
    table = order[:blocks].to(torch.int32)[None, :]
    pos = torch.arange(context)
    prefix_slots = (table[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).tolist()
    if kind == "tree":
        scratch = (order[blocks:blocks + scratch_blocks, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
        layout = BranchLayout(prefix_slots, context - TREE_K, [q % (TREE_K + 1) for q in range(rows)], [0] * rows,
                              scratch_slots=scratch.tolist())
        slots, _, mask = layout.step_inputs(TREE_STEP)
        tree = layout.step_item(TREE_STEP, [0] * layout.width(TREE_STEP)).tree
        prefix_len, extras = tree.visible, tree.extra_slots
        meta = build_metadata([slots], [rows], [mask])
    else:
        slots = prefix_slots
        prefix_len, extras = list(range(context - rows + 1, context + 1)), [[] for _ in range(rows)]
        meta = build_metadata([slots], [rows])
        mask = meta.mask[0]
    width = max(len(e) for e in extras)
    paged = (k, v, table.to(device), torch.zeros(rows, dtype=torch.int32, device=device),
             torch.tensor(prefix_len, dtype=torch.int32, device=device),
             torch.tensor(extras, dtype=torch.long, device=device).reshape(rows, width),
             torch.tensor([len(e) for e in extras], dtype=torch.int32, device=device), BLOCK_SIZE, DIM ** -0.5)
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(device, dtype)
    return Pass(kind, rows, context, paged, q, meta.to(device), mask.to(device),
                torch.tensor(slots, dtype=torch.long, device=device))


def time_ms(fn: Callable[[], torch.Tensor], replays: int) -> tuple[float, str]:
    """Median ms per call: CUDA-graph replays timed with events; eager calls where capture fails (or on a CPU)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        return _median_wall(fn, replays), "eager (cpu)"
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run, how = graph.replay, "graph"
    except Exception as e:  # noqa: BLE001 -- some paths cannot be captured; time them eagerly and say so
        log(f"capture failed ({type(e).__name__}: {e}); timing eager calls")
        run, how = fn, "eager"
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), how


def _median_wall(fn: Callable[[], torch.Tensor], replays: int) -> float:
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _flex(p: Pass) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention over the pass's context gathered once into [1, KVH, L, D], same visibility."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    k_cache, v_cache = p.paged[0], p.paged[1]
    k = k_cache[p.slots].transpose(0, 1)[None].contiguous()  # [1, KVH, L, D]
    v = v_cache[p.slots].transpose(0, 1)[None].contiguous()
    q = p.q.transpose(0, 1)[None].contiguous()  # [1, H, rows, D]
    visible = p.visible
    block_mask = create_block_mask(lambda b, h, qi, kv: visible[qi, kv], B=None, H=None, Q_LEN=p.rows,
                                   KV_LEN=k.shape[2], device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=block_mask, scale=p.paged[-1], enable_gqa=True)[0].transpose(0, 1)


def attention_table(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, contexts=CONTEXTS,
                    tree_rows=TREE_ROWS, flex: bool = True, replays: int = 200) -> list[dict]:
    """One row per (pass, context): ms per call of each path, the split count, and each path's error vs dense."""
    gen = torch.Generator().manual_seed(0)
    shapes = [("decode", 1), ("verify", VERIFY_ROWS)] + [("tree", n) for n in tree_rows]
    results = []
    for context in contexts:
        for kind, rows in shapes:
            p = make_pass(kind, rows, context, device, dtype, gen)
            out = torch.empty_like(p.q)
            k_cache, v_cache = p.paged[0], p.paged[1]
            dense = lambda: paged_attention(p.q, k_cache, v_cache, p.meta, p.paged[-1])  # noqa: E731
            triton = lambda: paged_attention_triton(p.q, *p.paged, out=out)  # noqa: E731
            reference = dense().float()
            row = {"pass": kind, "rows": rows, "context": context, "triton_err": (triton().float() - reference)
                   .abs().max().item()}
            row["triton_ms"], row["triton_timing"] = time_ms(triton, replays)
            row["dense_ms"], row["dense_timing"] = time_ms(dense, replays)
            row["splits"] = default_splits(p.q, k_cache, p.paged[2], p.paged[5], BLOCK_SIZE)
            if flex:
                try:
                    t0 = time.perf_counter()
                    run = _flex(p)
                    row["flex_err"] = (run().float() - reference).abs().max().item()
                    row["flex_compile_s"] = time.perf_counter() - t0
                    row["flex_ms"], row["flex_timing"] = time_ms(run, replays)
                except Exception as e:  # noqa: BLE001 -- report, keep the other columns
                    row["flex_error"] = f"{type(e).__name__}: {e}"[:200]
            results.append(row)
            log(f"{kind} rows={rows} context={context}: triton {row['triton_ms']:.4f} ms, "
                f"dense {row['dense_ms']:.4f} ms, flex {row.get('flex_ms')}")
    return results


def format_table(results: list[dict]) -> str:
    headers = ["pass", "rows", "context", "splits", "triton ms", "dense ms", "flex ms (gathered)",
               "dense / triton", "triton err", "flex err", "timing (triton/dense/flex)"]
    rows = [[r["pass"], r["rows"], r["context"], r["splits"], fmt(r["triton_ms"], ".4f"), fmt(r["dense_ms"], ".4f"),
             fmt(r.get("flex_ms", r.get("flex_error")), ".4f"), fmt(r["dense_ms"] / r["triton_ms"], ".2f"),
             fmt(r["triton_err"], ".1e"), fmt(r.get("flex_err"), ".1e"),
             "/".join(r.get(f"{c}_timing", "-") for c in ("triton", "dense", "flex"))] for r in results]
    return table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--contexts", type=int_list, default=list(CONTEXTS))
    p.add_argument("--tree-rows", type=int_list, default=list(TREE_ROWS))
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while per shape)")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    results = attention_table(args.device, dtype, args.contexts, args.tree_rows, not args.no_flex, args.replays)
    print(format_table(results))


if __name__ == "__main__":
    main()
