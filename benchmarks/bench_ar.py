"""AR decode speed of the target on one core: our bf16 fast path, transformers, and the bandwidth floor.

Target Qwen2.5-Coder-1.5B-Instruct, bf16, one thread pinned to core 0, greedy, real prompts:
HumanEval (the paper's dataset) and MT-Bench first turns (a substitute for the paper's chat
datasets), both in the chat template. Every request generates exactly --max-tokens tokens
(EOS ignored, transformers forced with min_new_tokens) so that both engines decode the same
lengths. Decode tok/s counts the tokens after the first over the time after the first (the
first token comes out of the prefill), median over prompts.

The floor: one decode step must read every weight matrix once (the packed matrices, output
head included, 3.09 GB for the 1.5B), so a step cannot take less than bytes / bandwidth.
Bandwidth is measured here, with a sum over a 2.4 GB fp32 tensor (a reduction, not a matmul),
in PyTorch's default allocation (4 KB pages) and in 2 MB huge pages (how the fast path stores
its weights; the faster of the two). Contention from other jobs can only lower a probe, so
the script probes three times (start, between engines, end) and the floor uses the highest
reading: the strictest floor.

This machine may be shared with other jobs. Wall-clock rates are the headline; CPU-time rates
(process CPU seconds, one thread) are printed beside them because another process on the
same core steals wall time but not CPU time. Memory-bus contention from the other core
slows both.

Also measured: throughput at several batch sizes (aggregate decode tok/s), and the cost of
one forward pass with 1..9 new rows (verification of K+1 tokens) and of tree-branch steps
with 8..16 rows under a branch mask, for the target and the 0.5B draft.

    python -m benchmarks.bench_ar                     # defaults: 4+4 prompts, 64 tokens (about 6 min)
    python -m benchmarks.bench_ar --core 1            # pinned to core 1 (when core 0 is busy with other jobs)
    python -m benchmarks.bench_ar --prompts 10 --max-tokens 128 --eager
    saguaro bench ar --prompts 1 --max-tokens 8 --skip-hf --batch-sizes 1 --no-step-costs   # smoke test
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (Prompt, add_model_args, dataset_labels, environment, fmt, int_list, log, median,
                               prepare_prompts, settings, str_list, table, write_results)
from saguaro.cores import pin_process
from saguaro.sampling.params import SamplingParams

CONTEXT = 256  # context length of the step-cost measurements


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="saguaro bench ar", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=4, help="prompts per dataset (default 4)")
    p.add_argument("--datasets", type=str_list, default=["humaneval", "mtbench"],
                   help="comma separated (default humaneval,mtbench)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 8], help="throughput batch sizes (default 1,4,8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--core", type=int, default=0,
                   help="first CPU core to pin to (cores core..core+threads-1; default 0). On a shared machine "
                        "pick a core nobody else is pinned to")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--eager", action="store_true", help="also time our eager path (enforce_eager=True; slow)")
    p.add_argument("--no-step-costs", dest="step_costs", action="store_false",
                   help="skip the per-forward costs of 1..9 rows and tree steps (target and draft)")
    p.add_argument("--bandwidth-gb", type=float, default=2.4, help="size of the bandwidth probe (default 2.4 GB)")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for bench_ar.json and .md")
    return p.parse_args(argv)


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def timed(fn: Any, reps: int) -> tuple[float, float]:
    """(median wall s, median CPU s) of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(reps):
        w, c = clocks()
        fn()
        w2, c2 = clocks()
        walls.append(w2 - w)
        cpus.append(c2 - c)
    return statistics.median(walls), statistics.median(cpus)


# -- bandwidth ---------------------------------------------------------------------------
def measure_bandwidth(gigabytes: float, reps: int = 5) -> dict[str, float]:
    """GB/s of a sum over an fp32 tensor, in default pages and in huge pages (median of ``reps``)."""
    from saguaro.backends.cpu_kernels import build as kernels
    n = int(gigabytes * 1e9) // 4
    out = {}
    x = torch.ones(n, dtype=torch.float32)
    out["default_pages_gb_s"] = n * 4 / timed(lambda: x.sum(), reps)[0] / 1e9
    del x
    if kernels.available():
        x = kernels.load().alloc_huge(n * 4).view(torch.float32).fill_(1.0)
        out["huge_pages_gb_s"] = n * 4 / timed(lambda: x.sum(), reps)[0] / 1e9
        del x
    gc.collect()
    return out


# -- our engine ----------------------------------------------------------------------------
def decode_one(llm: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One request stepped by hand: decode rate = tokens after the first / time after the first."""
    engine = llm.engine
    seq = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    w0 = time.perf_counter()
    while not seq.output_ids:
        engine.step()
    (w1, c1), first = clocks(), len(seq.output_ids)
    while not seq.finished:
        engine.step()
    w2, c2 = clocks()
    n = len(seq.output_ids) - first
    return {"prompt_tokens": len(ids), "new_tokens": len(seq.output_ids), "ttft_s": w1 - w0,
            "tok_s": n / (w2 - w1) if n else None, "cpu_tok_s": n / (c2 - c1) if n and c2 > c1 else None,
            "token_ids": list(seq.output_ids)}


def batch_throughput(llm: Any, prompts: list[Prompt], batch: int, max_tokens: int) -> dict[str, Any]:
    """``batch`` requests together; aggregate decode tok/s once every prefill is done."""
    engine = llm.engine
    seqs = [engine.add_request(prompts[i % len(prompts)].ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i in range(batch)]
    while not all(s.output_ids for s in seqs):
        engine.step()
    firsts = [len(s.output_ids) for s in seqs]
    (w1, c1), steps = clocks(), 0
    while not all(s.finished for s in seqs):
        engine.step()
        steps += 1
    w2, c2 = clocks()
    n = sum(len(s.output_ids) - f for s, f in zip(seqs, firsts))
    return {"batch": batch, "decode_tokens": n, "steps": steps, "tok_s": n / (w2 - w1),
            "cpu_tok_s": n / (c2 - c1) if c2 > c1 else None, "step_ms": 1e3 * (w2 - w1) / max(steps, 1),
            "cpu_step_ms": 1e3 * (c2 - c1) / max(steps, 1)}


def step_costs(runner: Any, rows: list[int], tree_rows: list[int], reps: int = 5) -> list[dict[str, Any]]:
    """Wall/CPU ms of one forward pass over a context of CONTEXT tokens, logits for every new row.

    ``rows``: n new tokens of one sequence under the causal mask (decode, K+1 verification);
    ``tree_rows``: n branch tokens that all sit at the same position, each seeing the context
    and itself (an SSD tree-branch step), as tree rows like SSD's.
    """
    from saguaro.engine.model_runner import ForwardItem, TreeRows
    table_: list[int] = []
    runner.blocks.reserve(table_, CONTEXT + max(rows + tree_rows))
    runner.forward([ForwardItem(list(range(100, 100 + CONTEXT)), 0, table_, "none")])  # real k/v in the context
    out = []
    for n in rows:
        item = ForwardItem(list(range(1000, 1000 + n)), CONTEXT, table_, "all")
        wall, cpu = timed(lambda: runner.forward([item]), reps)
        out.append({"kind": "rows", "rows": n, "wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu})
    for n in tree_rows:
        # n branches at one position, each seeing the context and itself: the SSD tree step's shape
        scratch = runner.slots(table_, CONTEXT, CONTEXT + n)
        rows_ = TreeRows([CONTEXT] * n, scratch, [CONTEXT] * n, [[slot] for slot in scratch])
        item = ForwardItem(list(range(2000, 2000 + n)), CONTEXT, table_, "all", tree=rows_)
        wall, cpu = timed(lambda: runner.forward([item]), reps)
        out.append({"kind": "tree", "rows": n, "wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu})
    runner.blocks.free(table_)
    base = out[0]["cpu_ms"] if out and out[0]["rows"] == 1 else None
    for r in out:
        r["x_one_row_cpu"] = r["cpu_ms"] / base if base else None
    return out


def draft_step_costs(name: str, threads: int, rows: list[int], tree_rows: list[int]) -> list[dict[str, Any]]:
    from saguaro.engine.model_runner import ModelRunner
    from saguaro.loading import load_model
    draft = load_model(name, dtype=torch.bfloat16, progress=False)
    runner = ModelRunner(draft.model, 64, 16, enforce_eager=False)
    costs = step_costs(runner, rows, tree_rows)
    del runner, draft
    gc.collect()
    return costs


# -- transformers --------------------------------------------------------------------------
class _Stamps:
    """A streamer that records (wall, CPU) times of each chunk of new tokens."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(clocks())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_decode(model: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    stamps = _Stamps()
    x = torch.tensor([ids])
    w0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, streamer=stamps, pad_token_id=model.config.pad_token_id)
    new = out[0, len(ids):].tolist()
    gen = stamps.times[1:]  # the first put is the prompt; then one put per new token
    n = len(gen) - 1
    (w1, c1), (w2, c2) = gen[0], gen[-1]
    return {"prompt_tokens": len(ids), "new_tokens": len(new), "ttft_s": w1 - w0,
            "tok_s": n / (w2 - w1) if n > 0 else None, "cpu_tok_s": n / (c2 - c1) if n > 0 and c2 > c1 else None,
            "token_ids": new}


# -- report --------------------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tok_s_median": median(r["tok_s"] for r in runs), "cpu_tok_s_median": median(r["cpu_tok_s"] for r in runs),
            "tok_s_min": min((r["tok_s"] for r in runs if r["tok_s"]), default=None),
            "tok_s_max": max((r["tok_s"] for r in runs if r["tok_s"]), default=None),
            "ttft_s_median": median(r["ttft_s"] for r in runs), "requests": len(runs)}


def report(args: argparse.Namespace, results: dict[str, Any]) -> str:
    floor = results["floor"]
    lines = [f"# AR decode on one core: {args.target}, bf16, {args.threads} thread(s)", "",
             f"{len(results['prompts'])} prompts ({', '.join(results['datasets'].values())}), "
             f"{args.max_tokens} new tokens each, greedy, EOS ignored. Decode tok/s excludes the prefill; "
             "medians over prompts. CPU rates use process CPU time (immune to time-slicing by other jobs, "
             "not to memory-bus contention).", ""]
    lines += [f"Bandwidth (sum over {args.bandwidth_gb:g} GB fp32, best of {len(floor['probes'])} probes): "
              f"{fmt(floor['bandwidth'].get('default_pages_gb_s'), '.1f')} GB/s in default pages, "
              f"{fmt(floor['bandwidth'].get('huge_pages_gb_s'), '.1f')} GB/s in huge pages. "
              f"Weights read per step: {floor['weight_bytes'] / 1e9:.3f} GB. "
              f"Floor: {1e3 * floor['floor_s']:.1f} ms/token = {floor['floor_tok_s']:.2f} tok/s "
              f"(at {floor['bandwidth_used_gb_s']:.1f} GB/s).", ""]
    rows = []
    for name, s in results["engines"].items():
        rows.append([name, fmt(s["tok_s_median"]), fmt(s["cpu_tok_s_median"]),
                     fmt(s.get("pct_floor"), ".0f"), fmt(s.get("cpu_pct_floor"), ".0f"),
                     fmt(s.get("pct_floor_default_pages"), ".0f"), fmt(s["ttft_s_median"], ".2f"), s.get("vs_hf", "-")])
    lines += [table(["engine", "decode tok/s", "CPU tok/s", "% of floor", "CPU % of floor", "% of 4K-page floor",
                     "TTFT s", "vs HF"], rows), ""]
    if results.get("agreement"):
        a = results["agreement"]
        lines += [f"Greedy agreement with transformers (both bf16): {a['identical']}/{a['compared']} outputs "
                  f"identical; mean common prefix {a['mean_common_prefix']:.1f} of {args.max_tokens} tokens.", ""]
    if results["batches"]:
        lines += ["## Throughput by batch size (fast path)", "",
                  table(["batch", "decode tok/s", "CPU tok/s", "ms/step", "CPU ms/step"],
                        [[b["batch"], fmt(b["tok_s"]), fmt(b["cpu_tok_s"]), fmt(b["step_ms"], ".1f"),
                          fmt(b["cpu_step_ms"], ".1f")] for b in results["batches"]]), ""]
    for model, costs in results.get("step_costs", {}).items():
        lines += [f"## One forward pass of {model} (fast path, context {CONTEXT}, logits for every row)", "",
                  table(["step", "rows", "wall ms", "CPU ms", "x one row (CPU)"],
                        [["K+1 verification / decode" if c["kind"] == "rows" else "tree branches", c["rows"],
                          fmt(c["wall_ms"], ".1f"), fmt(c["cpu_ms"], ".1f"), fmt(c["x_one_row_cpu"])]
                         for c in costs]), ""]
    lines += [f"Setup: kernels {results['setup']['kernels_s']:.1f} s (built once, then cached), "
              f"engine start (load + pack weights) {results['setup']['engine_s']:.1f} s.",
              f"Load average at start / end: {results['env_start']['loadavg']} / {results['env_end']['loadavg']}."]
    return "\n".join(lines)


def print_table(markdown: str) -> None:
    try:
        from rich.console import Console
        from rich.markdown import Markdown
        Console().print(Markdown(markdown))
    except ImportError:
        print(markdown)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from saguaro import LLM
    from saguaro.backends.cpu_kernels import build as kernels
    from saguaro.backends.cpu_kernels.model import FastCausalLM

    cores = list(range(args.core, args.core + args.threads))
    pin_process(cores, args.threads)
    env_start = environment()
    results: dict[str, Any] = {"settings": settings(args), "env_start": env_start, "engines": {}, "runs": {}}
    log("kernels: building or loading")
    t = time.perf_counter()
    kernels.load()
    kernels_s = time.perf_counter() - t
    probes = [measure_bandwidth(args.bandwidth_gb)]
    log(f"bandwidth probe: {probes[-1]}")

    options = dict(dtype="bfloat16", threads=args.threads, target_cores=cores,
                   max_model_len=4096, kv_cache_tokens=8192)
    t = time.perf_counter()
    llm = LLM(args.target, **options)
    engine_s = time.perf_counter() - t
    net = llm.engine.target.net
    if not isinstance(net, FastCausalLM):
        log("warning: the fast path is off on this machine; timing the eager path")
    prompts = prepare_prompts(llm.tokenizer, args.datasets, args.prompts)
    results["datasets"] = dataset_labels(args.datasets)
    results["prompts"] = [{"dataset": p.dataset, "index": p.index, "tokens": len(p.ids)} for p in prompts]
    log(f"{len(prompts)} prompts; engine ready in {engine_s:.1f} s")

    decode_one(llm, prompts[0].ids, 4)  # warm-up
    ours = []
    for p in prompts:
        ours.append(decode_one(llm, p.ids, args.max_tokens) | {"dataset": p.dataset, "index": p.index})
        log(f"  saguaro | {p.dataset}[{p.index}]: {ours[-1]['tok_s']:.2f} tok/s ({ours[-1]['cpu_tok_s']:.2f} CPU)")
    results["runs"]["saguaro"] = ours
    results["batches"] = []
    for b in args.batch_sizes:
        results["batches"].append(batch_throughput(llm, prompts, b, args.max_tokens))
        log(f"  batch {b}: {results['batches'][-1]['tok_s']:.2f} tok/s")
    if args.step_costs:
        log("step costs: target")
        results["step_costs"] = {args.target: step_costs(llm.engine.target, [1, 3, 5, 9], [8, 12, 16])}
    weight_bytes = (net.arena.numel() if isinstance(net, FastCausalLM) else
                    sum(p.numel() * p.element_size() for n, p in net.named_parameters()
                        if "embed_tokens" not in n or net.config.tie_word_embeddings))
    llm.close()
    del llm, net
    gc.collect()
    if args.step_costs:
        log("step costs: draft")
        results["step_costs"][args.draft] = draft_step_costs(args.draft, args.threads, [1, 3, 5, 9], [8, 12, 16])

    probes.append(measure_bandwidth(args.bandwidth_gb))
    log(f"bandwidth probe: {probes[-1]}")
    if args.eager:
        with LLM(args.target, **(options | {"enforce_eager": True})) as eager:
            decode_one(eager, prompts[0].ids, 2)
            results["runs"]["saguaro eager"] = [decode_one(eager, p.ids, args.max_tokens) for p in prompts]
        gc.collect()
    if not args.skip_hf:
        from benchmarks.hf_baseline import load_hf
        log("transformers: loading")
        hf = load_hf(args.target)
        hf_decode(hf, prompts[0].ids, 4)  # warm-up
        runs = []
        for p in prompts:
            runs.append(hf_decode(hf, p.ids, args.max_tokens) | {"dataset": p.dataset, "index": p.index})
            log(f"  transformers | {p.dataset}[{p.index}]: {runs[-1]['tok_s']:.2f} tok/s")
        results["runs"]["transformers"] = runs
        del hf
        gc.collect()
        pairs = [(a["token_ids"], b["token_ids"]) for a, b in zip(ours, runs)]
        results["agreement"] = {"identical": sum(a == b for a, b in pairs), "compared": len(pairs),
                                "mean_common_prefix": statistics.fmean(common_prefix(a, b) for a, b in pairs)}

    probes.append(measure_bandwidth(args.bandwidth_gb))
    log(f"bandwidth probe: {probes[-1]}")
    bandwidth = {key: max(p[key] for p in probes) for key in probes[0]}
    bw = max(bandwidth.values())
    floor_s = weight_bytes / (bw * 1e9)
    results["floor"] = {"bandwidth": bandwidth, "probes": probes, "bandwidth_used_gb_s": bw,
                        "weight_bytes": weight_bytes,
                        "floor_s": floor_s, "floor_tok_s": 1 / floor_s}
    hf_rate = None
    for name, runs in results["runs"].items():
        s = summarize(runs)
        s["pct_floor"] = 100 * s["tok_s_median"] * floor_s if s["tok_s_median"] else None
        s["cpu_pct_floor"] = 100 * s["cpu_tok_s_median"] * floor_s if s["cpu_tok_s_median"] else None
        # the same against the default-page bandwidth (the floor with 4 KiB pages, as a plain sum streams)
        s["pct_floor_default_pages"] = (100 * s["tok_s_median"] * weight_bytes / (bandwidth["default_pages_gb_s"] * 1e9)
                                        if s["tok_s_median"] else None)
        results["engines"][name] = s
        hf_rate = s["tok_s_median"] if name == "transformers" else hf_rate
    for name, s in results["engines"].items():
        s["vs_hf"] = f"{s['tok_s_median'] / hf_rate:.2f}x" if hf_rate and s["tok_s_median"] else "-"
    results["setup"] = {"kernels_s": kernels_s, "engine_s": engine_s}
    results["env_end"] = environment()
    markdown = report(args, results)
    print_table(markdown)
    json_path, md_path = write_results(args.out, "bench_ar", results, markdown)
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
