"""``saguaro train-head``: label text with the target, train an EAGLE-3 head, report held-out agreement.

Everything lands in ``--out`` (default ``~/.cache/saguaro/eagle/<target>``): ``labels.pt`` (the target's
labels, computed once), ``trainer.pt`` (head, optimizer and step: a rerun resumes from it), ``head/`` (the
head as an HF directory: ``LLM(target=..., draft=".../head", mode="sd")``) and ``report.json``.
Held-out text is the first ``data.EVAL_ITEMS`` HumanEval prompts, which training never reads.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from saguaro.loading.paths import cache_root


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="registry name, .gguf file or HF directory")
    p.add_argument("--out", help="output directory (default ~/.cache/saguaro/eagle/<target>)")
    p.add_argument("--train-tokens", type=int, default=20_000, help="tokens of text the target labels")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per example")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (one example each)")
    p.add_argument("--minutes", type=float, help="stop training after this many minutes")
    p.add_argument("--ttt-steps", type=int, default=7,
                   help="chained steps per example (training-time test; EAGLE-3's 7), weighted 0.8^j")
    p.add_argument("--draft-vocab", type=int, default=32_000, help="the head's output vocabulary")
    p.add_argument("--top-k", type=int, default=16, help="target probabilities kept per position as labels")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--dtype", default="auto", help="the target's dtype (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from saguaro.config import DTYPES
    from saguaro.loading.place import load_or_place
    from saguaro.eagle.checkpoint import default_taps
    from saguaro.eagle.data import EVAL_ITEMS, chunk_texts, label, training_texts
    from saguaro.eagle.head import Eagle3Head
    from saguaro.eagle.train import TrainSettings, evaluate, new_head, pick_vocabulary, train
    from saguaro.engine.model_runner import ModelRunner
    from saguaro.loading.dtype import checkpoint_dtype
    from saguaro import datasets

    if args.steps < 1 or args.ttt_steps < 1 or args.seq_len < 16 or args.train_tokens < args.seq_len:
        raise ValueError("train-head needs --steps >= 1, --ttt-steps >= 1, --seq-len >= 16 and "
                         "--train-tokens >= --seq-len")
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else cache_root() / "eagle" / Path(args.target).name
    out.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[checkpoint_dtype(args.target) if args.dtype == "auto" else args.dtype]
    target = load_or_place(args.target, "cpu", dtype)
    labels_path = out / "labels.pt"
    if labels_path.exists():
        cached = torch.load(labels_path, weights_only=False)
        examples, held_out = cached["train"], cached["held_out"]
    else:
        chunks = chunk_texts(target.tokenizer, training_texts(), args.seq_len, args.train_tokens)
        held = chunk_texts(target.tokenizer, datasets.humaneval()[:EVAL_ITEMS], args.seq_len, args.train_tokens // 8)
        runner = ModelRunner(target.model, -(-args.seq_len // 16) + 1, 16, "cpu", enforce_eager=True)
        taps = default_taps(target.config.num_layers)
        started = time.monotonic()
        with tqdm(total=sum(map(len, chunks + held)), desc="target labels", unit="tok") as bar:
            examples = label(runner, taps, chunks, args.top_k, bar)
            held_out = label(runner, taps, held, args.top_k, bar)
        target.model.taps = ()
        print(f"labelled {sum(map(len, chunks))} training and {sum(map(len, held))} held-out tokens in "
              f"{time.monotonic() - started:.0f} s")
        torch.save({"train": examples, "held_out": held_out}, labels_path)
    head: Eagle3Head = new_head(target.model, pick_vocabulary(examples, args.draft_vocab, target.config.vocab_size))
    settings = TrainSettings(ttt_steps=args.ttt_steps, lr=args.lr, steps=args.steps, minutes=args.minutes,
                             checkpoint_every=args.checkpoint_every)
    with tqdm(total=args.steps, desc="train head", unit="step") as bar:
        summary = train(head, examples, settings, out, bar)
    report = {"target": args.target, "settings": asdict(settings), **summary,
              "held_out": evaluate(head, held_out, args.ttt_steps)}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    agree = ", ".join(f"{a:.2f}" for a in report["held_out"]["per_step_agreement"])
    print(f"head saved to {out / 'head'}; held-out agreement per step: {agree}; "
          f"accepted per round (teacher-forced, K={args.ttt_steps}): {report['held_out']['accepted_per_round']:.2f}")
    return 0
