"""The CPU kernel tiers against the memory bus, one core: GEMM GB/s per tier and weight format, AR decode of the
1.5B bf16 target against its one-core floor, and one int4 0.5B draft step against its weights' floor.

Rates are in CPU time of the one thread (see best_rate): the dev machine is shared.

  * bus: a sum over a huge-page fp32 buffer (the copy/sum probe of calibration/bus.py, in process), the best of
    --reps windows;
  * GEMM: 1 x K by K x N (default the Qwen2.5-1.5B MLP shape, 1 x 1536 by 1536 x 8960), weights packed in
    huge pages, enough copies that each call streams from memory, not the caches; GB/s = packed bytes / time;
  * rows: the same GEMM over --rows rows against one row, per tier and format (``row_costs.measure``, the
    probe the default costs read): what a verification of K + 1 rows or a build step costs over a decode step;
  * AR: one 1-row decode step of the target in bf16 on the default tier (forward + logits at a context of 64),
    median of --steps steps, as tok/s; floor = packed bytes per token / bus;
  * draft step: the 0.5B with int4 weights and a 65,536-token head (the demo's draft), one row at a context of
    64, median of --steps steps; floor = its packed bytes / bus.

    python -m benchmarks.bench_cpu_tiers                       # about 3 minutes on a 2-core AMD EPYC Zen 3
    python -m benchmarks.bench_cpu_tiers --tiers avx2 --no-models
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_model_args, environment, log, table, write_results
from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels import row_costs
from saguaro.backends.cpu_kernels.layout import matrix_bytes, packed_copies
from saguaro.backends.cpu_kernels.model import FastCausalLM, pass_bytes
from saguaro.cores import pin_process
from saguaro.info import cpu_name

FORMATS = ("bf16", "int8", "int4")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiers", type=lambda s: s.split(","), default=kernels.runnable_tiers())
    p.add_argument("--n", type=int, default=8960, help="GEMM outputs (default 8960)")
    p.add_argument("--k", type=int, default=1536, help="GEMM inputs (default 1536)")
    p.add_argument("--reps", type=int, default=5, help="windows per measurement (best kept; default 5)")
    p.add_argument("--steps", type=int, default=20, help="draft steps timed (default 20)")
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 3, 4, 5, 6, 8, 16],
                   help="row counts of the row-cost table (default 1,2,3,4,5,6,8,16)")
    p.add_argument("--no-models", dest="models", action="store_false", help="kernels and bus only")
    add_model_args(p)
    p.add_argument("--core", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results"))
    return p.parse_args(argv)


def best_rate(nbytes: int, fn: Any, reps: int, calls: int) -> float:
    """Bytes per second of ``calls`` calls of ``fn`` each reading ``nbytes``, best of ``reps`` windows, in this
    thread's CPU time: on a shared machine other processes take wall time from the core but not CPU time (they
    still load the memory bus)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, time.thread_time() - t)
    return nbytes * calls / best


def bus_bandwidth(reps: int, nbytes: int = 1 << 30) -> float:
    x = kernels.load().alloc_huge(nbytes).view(torch.float32).fill_(1.0)
    return best_rate(nbytes, x.sum, reps, 2)


def gemm_rates(tier: str, n: int, k: int, reps: int) -> dict[str, float]:
    """GB/s of a 1-row GEMM per format; copies of the matrix rotate so that calls stream from memory."""
    ops, x = kernels.load(tier), torch.randn(1, k).bfloat16()
    w = torch.randn(n, k).bfloat16() * 0.05
    out = {}
    for weights in FORMATS:
        packed = packed_copies(ops, w, weights, 256 << 20)
        size, copies = matrix_bytes(n, k, weights), len(packed)
        turn = iter(range(1 << 62))
        out[weights] = best_rate(size, lambda: ops.gemm(x, packed[next(turn) % copies], n, None, None, 0, False),
                                 reps, copies) / 1e9
        log(f"{tier} {weights}: {out[weights]:.1f} GB/s")
    return out


def decode_steps(name: str, weights: str, vocab: int | None, steps: int) -> dict[str, Any]:
    """Median CPU time of one 1-row decode step (forward + logits) of ``name`` packed as ``weights`` (head: the
    first ``vocab`` ids and the special tokens), at a context of 64, and its packed bytes per step."""
    from saguaro.kv.kv_cache import KVCache
    from saguaro.kv.metadata import build_metadata
    from saguaro.loading import load_model
    from saguaro.models.draft_format import DraftFormat
    loaded = load_model(name, torch.bfloat16, progress=False)
    head = DraftFormat(weights, vocab).head_ids(loaded)
    fast = FastCausalLM(loaded.model, weights, head)
    cache = KVCache(loaded.config, 8, 16, torch.bfloat16)
    times = []
    for i in range(steps + 2):
        meta = build_metadata([list(range(65 + i))], [1])
        ids, pos = torch.tensor([(100 + i) % loaded.config.vocab_size]), torch.tensor([64 + i])
        t = time.thread_time()
        fast.logits(fast(ids, pos, cache, meta))
        times.append(time.thread_time() - t)
    rows = loaded.config.vocab_size if head is None else len(head)
    return {"step_s": statistics.median(times[2:]), "tier": fast.tier,
            "bytes_per_step": pass_bytes(loaded.config, weights, rows)}


def markdown(r: dict[str, Any]) -> str:
    bus = r["bus_gb_s"]
    rows = [[tier, *[f"{g[w]:.1f} ({g[w] / bus:.0%})" for w in FORMATS]] for tier, g in r["gemm_gb_s"].items()]
    counts = r["rows"]
    costs = [[tier, w, *[f"{c[w][str(m)]:.2f}" for m in counts]] for tier, c in r["row_costs"].items() for w in FORMATS]
    lines = [f"# CPU kernel tiers on {r['cpu']}, one core", "",
             f"Bus: {bus:.1f} GB/s (sum over 1 GiB in huge pages, one core). GEMM 1 x {r['k']} by {r['k']} x "
             f"{r['n']}, packed weights streamed from memory: GB/s (share of the bus).", "",
             table(["tier", *FORMATS], rows), "",
             f"The same GEMM over n rows against one row (a verification of K + 1 rows, a build step; the least of "
             f"{r['reps']} rounds):", "", table(["tier", "weights", *[f"{m} rows" for m in counts]], costs)]
    if "ar" in r:
        ar, dr = r["ar"], r["draft"]
        lines += ["", f"AR, {r['target']} bf16 ({ar['tier']}): {ar['tok_s']:.2f} tok/s against a one-core floor of "
                      f"{ar['floor_tok_s']:.2f} ({ar['bytes_per_step'] / 1e9:.2f} GB per token): "
                      f"{ar['tok_s'] / ar['floor_tok_s']:.0%} of the floor.",
                  f"Draft step, {r['draft_model']} int4 + 65,536-token head ({dr['tier']}): "
                  f"{dr['step_s'] * 1e3:.1f} ms against "
                  f"a floor of {dr['floor_s'] * 1e3:.1f} ms ({dr['bytes_per_step'] / 1e9:.3f} GB): "
                  f"{dr['step_s'] / dr['floor_s']:.2f}x the floor."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pin_process([args.core], 1)
    bus = bus_bandwidth(args.reps) / 1e9
    log(f"bus: {bus:.1f} GB/s")
    isa = ", ".join(f for f in ("avx512_bf16", "avx2") if f in kernels.cpu_flags())
    r: dict[str, Any] = {"cpu": f"{cpu_name()} ({isa})", "env": environment(), "n": args.n, "k": args.k,
                         "bus_gb_s": bus}
    r["gemm_gb_s"] = {t: gemm_rates(t, args.n, args.k, args.reps) for t in args.tiers}
    r["rows"], r["reps"] = sorted(set(args.rows) | {1}), args.reps
    r["row_costs"] = {t: {w: {str(m): c for m, c in row_costs.measure(kernels.load(t), w, tuple(r["rows"]), args.reps,
                                                                      args.n, args.k, 256 << 20).items()}
                          for w in FORMATS} for t in args.tiers}
    if args.models:
        ar = decode_steps(args.target, "bf16", None, args.steps)
        ar["tok_s"], ar["floor_tok_s"] = 1 / ar["step_s"], bus * 1e9 / ar["bytes_per_step"]
        dr = decode_steps(args.draft, "int4", 65536, args.steps)
        dr["floor_s"] = dr["bytes_per_step"] / (bus * 1e9)
        r.update(target=args.target, draft_model=args.draft, ar=ar, draft=dr)
    md = markdown(r)
    print(md)
    write_results(args.out, "cpu_tiers", r, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
