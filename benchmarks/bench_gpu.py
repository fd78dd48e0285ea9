"""The engine on a GPU: AR and SD decode speed, the cost of every pass shape, the HBM floor, transformers.

Random weights of real shapes (``benchmarks/synthetic.py``): Qwen2.5 1.5B target with the 0.5B draft by
default, Llama-3.1-8B with Llama-3.2-1B with ``--shapes llama-3.1-8b``. A pass costs what its shapes cost,
whatever the weights hold; acceptance does not carry over from real models, so SD figures print their
acceptance beside them (random models mostly repeat their input: a best case for speculation).

One run gives, side by side, bf16, a ``--context``-token prompt, greedy:
* the HBM floor: weight bytes over a measured device-to-device copy bandwidth;
* ms per pass through the engine's runner (CUDA graphs unless ``--enforce-eager``): target decode (1 row),
  verification (K+1 = 2..8 rows), draft step (1 row), SSD tree steps (8..64 rows on the draft);
* AR decode tok/s at batch 1, 8 and 32 (all requests together);
* SD at K = 2..6: tok/s, tokens per round, and the round time against the sum of its passes;
* transformers ``generate`` (eager) on the same weights, batch 1.

    python -m benchmarks.bench_gpu                                   # Qwen2.5 1.5B / 0.5B shapes
    python -m benchmarks.bench_gpu --shapes qwen2.5-1.5b,llama-3.1-8b --max-tokens 128
    python -m benchmarks.bench_gpu --device cpu --shapes tiny --max-tokens 8 --batches 1 --sd-k 2 --no-hf  # smoke
    python -m benchmarks.bench_gpu --mode ssd ...                    # benchmarks/bench_gpu_ssd.py
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import environment, fmt, int_list, log, median, settings, str_list, table, write_results
from benchmarks.synthetic import PAIRS, SHAPES, prompts, random_model, weight_bytes
from saguaro import LLM, SamplingParams
from saguaro.engine.model_runner import ForwardItem, ModelRunner, TreeRows
from saguaro.host_memory import resident_bytes

GOALS = {"ar_tok_s": 400.0, "verify5_over_decode": 1.15, "draft_step_ms": 1.3, "sd_round_over_passes": 1.1,
         "ar_batch32_tok_s": 6000.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=str_list, default=["qwen2.5-1.5b"], help=f"targets: {', '.join(PAIRS)}")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--sd-k", type=int_list, default=[2, 3, 4, 5, 6])
    p.add_argument("--verify-rows", type=int_list, default=[2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--tree-rows", type=int_list, default=[8, 16, 32, 64])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--enforce-eager", action="store_true", help="the eager reference instead of CUDA graphs")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--mode", type=str_list, default=["ar", "sd"],
                   help="ar, sd; or ssd alone: SSD against AR and SD on a synthetic pair (benchmarks/bench_gpu_ssd.py, "
                        "its own options: --mode ssd --help)")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--name", default="bench_gpu")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall ms of ``fn`` followed by a device sync (what a pass costs the engine, host work included)."""
    for _ in range(3):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy GB/s, counting bytes read and written (the HBM figure the floor divides by)."""
    if device.type != "cuda":
        return None
    buffers = [torch.empty(1 << 30, dtype=torch.uint8, device=device) for _ in range(2)]
    ms = timed_ms(lambda: buffers[1].copy_(buffers[0]), device, 10)
    buffers.clear()  # give the 2 GiB back before the models are built
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def pass_costs(loaded, device: torch.device, enforce_eager: bool, args, rows: list[int], tree_rows: list[int]) -> dict:
    """ms per pass over a ``--context``-token sequence: causal passes of n rows, and tree steps of n branches
    (each at the same position, seeing the context and itself, as an SSD build's first step)."""
    ctx = args.context
    runner = ModelRunner(loaded.model, 2 * (ctx + 128) // 16 + 8, 16, str(device), enforce_eager=enforce_eager,
                         max_seq_len=2 * ctx)
    table_: list[int] = []
    runner.blocks.reserve(table_, ctx + max(rows + tree_rows + [1]))
    runner.forward([ForwardItem(prompts(loaded.config.vocab_size, 1, ctx)[0], 0, table_, "none")])
    out = {}
    for n in rows:
        item = ForwardItem(list(range(1, n + 1)), ctx, table_, "all")
        out[f"rows_{n}"] = timed_ms(lambda: runner.forward([item]), device, args.reps)
    for n in tree_rows:
        scratch = runner.slots(table_, ctx, ctx + n)
        item = ForwardItem(list(range(1, n + 1)), ctx, table_, "all",
                           tree=TreeRows([ctx] * n, scratch, [ctx] * n, [[s] for s in scratch]))
        out[f"tree_{n}"] = timed_ms(lambda: runner.forward([item]), device, args.reps)
    out["backend"] = runner.backend.name
    runner.close()
    return out


def engine_run(target, draft, mode: str, k: int, batch: int, args, enforce_eager: bool) -> dict:
    """Decode tok/s of ``batch`` requests together (all tokens after each request's first, over the longest
    decode), with speculation metrics. Every prompt prefills in one step, so that no prefill step of another
    request lands among the decode steps timed; SD runs the K it names (no adaptation)."""
    options = dict(device=args.device, dtype="bfloat16", enforce_eager=enforce_eager, max_num_seqs=max(batch, 1),
                   kv_cache_tokens=max(batch, 1) * (args.context + args.max_tokens + 16) + 1024,
                   max_model_len=args.context + args.max_tokens + 16,
                   max_prefill_tokens=max(batch, 1) * args.context)
    if mode != "ar":
        options.update(mode=mode, draft=draft, num_speculative_tokens=k, adaptive=False)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    ids = prompts(target.config.vocab_size, batch, args.context, seed=batch)
    with LLM(target=target, **options) as llm:
        llm.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (graphs: captured at start-up)
        outs = llm.generate(ids, params)
        spec = llm.spec_metrics(outs)
        host = resident_bytes() / 1e9  # this process's host memory with the engine loaded (weights on the device)
    tok_s, per_request, decode_s = batch_rates(outs)
    row = {"mode": mode, "k": k if mode != "ar" else None, "batch": batch,
           "tok_s": tok_s, "per_request_tok_s": per_request, "host_rss_gb": host}
    if spec is not None:
        row.update(acceptance=spec.acceptance_rate, tokens_per_round=spec.tokens_per_round,
                   round_ms=1e3 * decode_s * batch / max(spec.rounds, 1))
    return row


def batch_rates(outs) -> tuple[float | None, float, float]:
    """Of requests decoded together: all their decode tokens (each one's after its first) per second over the
    longest decode, the median request's decode tok/s, and that longest decode (s)."""
    decode_s = max(o.timings.total_s - o.timings.ttft_s for o in outs)
    tok_s = sum(len(o.token_ids) - 1 for o in outs) / decode_s if decode_s > 0 else None
    return tok_s, median(o.timings.decode_tokens_per_s for o in outs), decode_s


def hf_generate(loaded, args) -> float | None:
    """transformers ``generate`` (eager, greedy) on the same weights: decode tok/s at batch 1."""
    import transformers
    cfg = loaded.config
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                  max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.arch == "llama":
        hf_cfg = transformers.LlamaConfig(**common, head_dim=cfg.head_dim, rope_scaling=cfg.rope_scaling)
        cls = transformers.LlamaForCausalLM
    else:
        hf_cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    device = torch.device(args.device)
    with torch.device(device):
        hf = cls(hf_cfg).to(torch.bfloat16).eval()
    hf.load_state_dict(loaded.model.state_dict(), strict=False)
    ids = torch.tensor(prompts(cfg.vocab_size, 1, args.context), device=device)
    stamps: list[float] = []

    class Stamp(transformers.generation.streamers.BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        hf.generate(ids, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                    streamer=Stamp())
    del hf
    gc.collect()
    # the first put is the prompt, the second the first new token: decode is everything after it
    return (len(stamps) - 2) / (stamps[-1] - stamps[1]) if len(stamps) > 3 else None


def run_shape(shape: str, args, bandwidth: float | None) -> dict:
    device = torch.device(args.device)
    eager = args.enforce_eager
    log(f"{shape}: building random weights on {device}")
    target = random_model(shape, str(device), seed=0)
    draft = random_model(PAIRS[shape], str(device), seed=1)
    result: dict[str, Any] = {"target": shape, "draft": PAIRS[shape], "target_gb": weight_bytes(target.model) / 1e9,
                              "draft_gb": weight_bytes(draft.model) / 1e9, "host_rss_gb": resident_bytes() / 1e9}
    if bandwidth:
        result["floor_ms"] = weight_bytes(target.model) / (bandwidth * 1e9) * 1e3
    log("pass costs")
    result["target_passes"] = pass_costs(target, device, eager, args, [1] + args.verify_rows, [])
    result["draft_passes"] = pass_costs(draft, device, eager, args, [1, 8, 32], args.tree_rows)
    rows = []
    if "ar" in args.mode:
        for b in args.batches:
            log(f"AR batch {b}")
            rows.append(engine_run(target, None, "ar", 0, b, args, eager))
    if "sd" in args.mode:
        for k in args.sd_k:
            log(f"SD K={k}")
            row = engine_run(target, draft, "sd", k, 1, args, eager)
            tp, dp = result["target_passes"], result["draft_passes"]
            passes = tp.get(f"rows_{k + 1}", tp["rows_1"]) + k * dp["rows_1"]
            row["passes_ms"] = passes
            row["round_over_passes"] = row["round_ms"] / passes if row.get("round_ms") else None
            rows.append(row)
    result["engine"] = rows
    if not args.no_hf:
        log("transformers generate")
        result["hf_tok_s"] = hf_generate(target, args)
    del target, draft
    gc.collect()
    return result


def goals(r: dict) -> list[list[Any]]:
    """The fast-path goals against this run (Qwen2.5-1.5B shape, batch 1, bf16)."""
    ar = {row["batch"]: row["tok_s"] for row in r["engine"] if row["mode"] == "ar"}
    sd = [row["round_over_passes"] for row in r["engine"] if row["mode"] == "sd" and row.get("round_over_passes")]
    tp, dp = r["target_passes"], r["draft_passes"]
    checks = [("AR tok/s, batch 1", ar.get(1), GOALS["ar_tok_s"], "min"),
              ("5-row verification / 1-row decode", tp.get("rows_5", 0) / tp["rows_1"] if "rows_5" in tp else None,
               GOALS["verify5_over_decode"], "max"),
              ("draft step ms", dp["rows_1"], GOALS["draft_step_ms"], "max"),
              ("SD round / sum of its passes (worst K)", max(sd) if sd else None, GOALS["sd_round_over_passes"], "max"),
              ("AR tok/s, batch 32, all requests", ar.get(32), GOALS["ar_batch32_tok_s"], "min")]
    return [goal_row(*check) for check in checks]


def goal_row(name: str, value: float | None, goal: float, kind: str) -> list[str]:
    """[name, measured, goal, met / not met] of a goals table; ``kind`` "min" (at least the goal), "max" (at
    most) or "abs" (|value| at most: an error)."""
    met = None if value is None else {"min": value >= goal, "max": value <= goal, "abs": abs(value) <= goal}[kind]
    shown = fmt(value, "+.1%") if kind == "abs" else fmt(value)
    bound = {"min": "≥ ", "max": "≤ ", "abs": "± "}[kind] + (fmt(goal, ".0%") if kind == "abs" else fmt(goal))
    return [name, shown, bound, {None: "-", True: "met", False: "not met"}[met]]


def report(results: list[dict], bandwidth: float | None, args) -> str:
    lines = [f"# The engine on {args.device}: random weights of real shapes, bf16, context {args.context}, greedy",
             "", f"Copy bandwidth: {fmt(bandwidth, '.0f')} GB/s (read + write).", ""]
    for r in results:
        lines += [f"## {r['target']} (target, {r['target_gb']:.2f} GB) / {r['draft']} "
                  f"(draft, {r['draft_gb']:.2f} GB)",
                  "", f"HBM floor for one target step: {fmt(r.get('floor_ms'), '.3f')} ms "
                  f"({fmt(1e3 / r['floor_ms'] if r.get('floor_ms') else None, '.0f')} tok/s); "
                  f"backend {r['target_passes']['backend']}; host resident memory with both models on the device: "
                  f"{fmt(r.get('host_rss_gb'), '.2f')} GB.", ""]
        tp, dp = r["target_passes"], r["draft_passes"]
        lines += [table(["pass", "rows", "ms"],
                        [["target decode / verification", k.split("_")[1], fmt(v, ".3f")] for k, v in tp.items()
                         if k.startswith("rows_")]
                        + [["draft step", k.split("_")[1], fmt(v, ".3f")] for k, v in dp.items()
                           if k.startswith("rows_")]
                        + [["draft tree step", k.split("_")[1], fmt(v, ".3f")] for k, v in dp.items()
                           if k.startswith("tree_")]), ""]
        lines += [table(["mode", "K", "batch", "tok/s (all requests)", "per request", "acceptance", "tokens/round",
                         "round ms", "sum of passes ms", "round / passes", "host RSS GB"],
                        [[e["mode"], fmt(e["k"], "d"), e["batch"], fmt(e["tok_s"], ".1f"),
                          fmt(e["per_request_tok_s"], ".1f"), fmt(e.get("acceptance")), fmt(e.get("tokens_per_round")),
                          fmt(e.get("round_ms"), ".3f"), fmt(e.get("passes_ms"), ".3f"),
                          fmt(e.get("round_over_passes")), fmt(e.get("host_rss_gb"), ".2f")] for e in r["engine"]]), ""]
        if "hf_tok_s" in r:
            lines += [f"transformers generate (eager), batch 1: {fmt(r['hf_tok_s'], '.1f')} tok/s.", ""]
        if r["target"] == "qwen2.5-1.5b":
            lines += [table(["goal", "measured", "goal", ""], goals(r)), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--mode", type=str_list, default=["ar", "sd"])
    chosen, rest = mode.parse_known_args(argv)
    if "ssd" in chosen.mode:  # its own benchmark, which runs AR and SD beside SSD on the synthetic pair
        if chosen.mode != ["ssd"]:
            raise SystemExit("--mode ssd runs AR and SD beside SSD itself: give it alone (--mode ssd)")
        from benchmarks.bench_gpu_ssd import main as ssd_main
        return ssd_main(rest)
    args = parse_args(argv)
    unknown = [s for s in args.shapes if s not in PAIRS]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known targets: {', '.join(PAIRS)} "
                         f"(all shapes: {', '.join(SHAPES)})")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench gpu needs a CUDA device (or --device cpu --shapes tiny for a smoke test)")
    bandwidth = copy_bandwidth(device)
    results = [run_shape(shape, args, bandwidth) for shape in args.shapes]
    text = report(results, bandwidth, args)
    print(text)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_results(args.out, args.name, {"environment": environment(), "device": device_name, "settings": settings(args),
                                        "bandwidth_gb_s": bandwidth, "results": results}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
