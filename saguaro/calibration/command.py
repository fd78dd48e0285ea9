"""``saguaro calibrate``: load the pair, measure it, store the profile, print what the engine will pick."""
from __future__ import annotations

import argparse
import json
import math

import torch

from saguaro.calibration.store import load_profile, profile_path, save_profile
from saguaro.config import DTYPES, WORKLOADS
from saguaro.cores import pin_process
from saguaro.loading import check_shared_vocabulary, load_model
from saguaro.models.draft_format import WEIGHT_FORMATS
from saguaro.models.draft_format import DraftFormat
from saguaro.removed import add_removed_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target-weights", default="bf16", choices=WEIGHT_FORMATS,
                   help="the target's weight format, as the engine will run it (int8, int4: the CPU kernels, bf16 "
                        "dtype, the fast path); the profile is keyed by it")
    p.add_argument("--draft-weights", default="bf16", choices=WEIGHT_FORMATS,
                   help="the draft's weight format, as the engine will run it (the profile is keyed by it)")
    p.add_argument("--draft-vocab", type=int, default=None, help="the draft head keeps token ids below this")
    p.add_argument("--workload", default="mixed", choices=WORKLOADS,
                   help="held-out prompts to calibrate on: code (HumanEval), chat (MT-Bench) or both; a workload "
                        "other than mixed gets its own profile (the engine's calibration_workload)")
    p.add_argument("--k", type=int, default=4, help="lookahead K used while calibrating")
    p.add_argument("--temperatures", default="0,1", help="comma separated")
    p.add_argument("--c-values", default="",
                   help="Saguaro C values < 1 to calibrate at temperatures > 0, e.g. 0.5,0.25")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (last HumanEval and MT-Bench items)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together while recording ranks")
    p.add_argument("--max-rows", type=int, default=64, help="largest forward (rows) to time")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--core", type=int, default=0, help="CPU core to pin to (-1: no pinning)")
    p.add_argument("--max-batch", type=int, default=16, help="batch sizes to show the plan for")
    p.add_argument("--enforce-eager", action="store_true",
                   help="calibrate the eager reference instead of the fast path (stored as its own profile)")
    add_removed_flags(p, "--compile")
    p.add_argument("--timing-only", action="store_true",
                   help="re-measure only the timings of the stored profile (e.g. on a quieter machine)")
    p.add_argument("--no-contention", action="store_true",
                   help="skip the probe of how much the draft on core 1 slows verification on core 0 (memory bus)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--json", help="also write the profile to this path")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    # the measuring and planning code loads only for `saguaro calibrate`, not with every command's parser
    from saguaro.calibration.measure import calibrate, kernel_tier, measure_timing
    from saguaro.calibration.policy import make_plan, recommended_k
    from saguaro.ssd_settings import MissStrategy, SSDSettings
    weights = args.target_weights
    if weights != "bf16" and (args.enforce_eager or DTYPES[args.dtype] != torch.bfloat16):
        raise SystemExit(f"saguaro calibrate: --target-weights {weights} runs on the CPU kernels' fast path: use "
                         "--dtype bfloat16 without --enforce-eager")
    pin_process([args.core] if args.core >= 0 else None, args.threads)
    dtype = DTYPES[args.dtype]
    eager = args.enforce_eager  # the engine's own default: the fast path
    fmt = DraftFormat(args.draft_weights, args.draft_vocab)
    target = load_model(args.target, dtype=dtype)
    draft = load_model(args.draft, dtype=fmt.dtype(dtype))
    check_shared_vocabulary(target.tokenizer, draft.tokenizer)
    if args.timing_only:
        profile = load_profile(args.target, args.draft, args.dtype, eager, fmt.tag, args.workload, weights)
        if profile is None and not eager:  # reuse the eager profile's ranks with fast-path timings
            profile = load_profile(args.target, args.draft, args.dtype, True, fmt.tag, args.workload, weights)
        if profile is None:
            path = profile_path(args.target, args.draft, args.dtype, True, fmt.tag, args.workload, weights)
            raise FileNotFoundError(f"no profile at {path}; run `saguaro calibrate` without --timing-only first")
        args.k = profile.k
        context = profile.timing.context or 256
        profile.timing = measure_timing(target, draft, args.k, context, args.max_rows, enforce_eager=eager,
                                        draft_format=fmt, contention=not args.no_contention, target_weights=weights)
        profile.enforce_eager = eager
        profile.kernels = kernel_tier(target, args.dtype, eager)
        timing = profile.timing
        print(f"timing: verify(K+1) {timing.verify_s * 1e3:.1f} ms, draft step {timing.draft_step_s * 1e3:.1f} ms, "
              f"T_p {timing.T_p:.2f}")
    else:
        profile = calibrate(target, draft, dtype=args.dtype, k=args.k, temperatures=_floats(args.temperatures),
                            c_values=_floats(args.c_values), prompts=args.prompts, max_tokens=args.max_tokens,
                            batch=args.batch, max_rows=args.max_rows, enforce_eager=eager, draft_format=fmt,
                            contention=not args.no_contention, workload=args.workload, target_weights=weights)
    if not args.no_save:
        print(f"profile saved to {save_profile(profile)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
    vocab = target.config.vocab_size
    settings = SSDSettings(fan_out="auto", miss_strategy=MissStrategy.AUTO, saguaro_c="auto")
    chosen = make_plan(profile, args.k, settings, args.max_batch, vocab)
    print(f"fan_out='auto', saguaro_c='auto', miss_strategy='auto' at K={args.k}: "
          f"{chosen.report.describe(settings.miss_strategy)}")
    b_star = chosen.plan.b_star
    print(_b_star_line(b_star))
    print(f"num_speculative_tokens='auto' would pick K={recommended_k(profile, 'jit', vocab)}")
    return 0


def _b_star_line(b_star: float) -> str:
    """Thm 18's b* in words: below 1 (it may be negative) the n-gram strategy wins from batch 1 on."""
    if not math.isfinite(b_star):
        return "miss_strategy='auto': jit at every batch size"
    if b_star <= 1.0:
        return "miss_strategy='auto': n-gram at every batch size"
    return f"miss_strategy='auto': jit for batch < {b_star:.2f}, n-gram from then on"
