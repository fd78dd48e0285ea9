"""A fingerprint of seeded outputs across every decoder (not a test file): run before and after a refactor.

A fixed set of prompts goes through AR, SD (a draft model, the n-gram proposer, an EAGLE-3 head) and SSD (a
draft model and an EAGLE-3 head, over the thread and the process transports), greedy and sampled at T=1 with
fixed seeds, on tiny random models in fp32 (the eager reference), bf16 (the device's fast path) and a
target sharded over 2 ranks. Sampled SSD over a transport depends on timing (a build the next request
cuts short turns a hit into a miss, which draws other numbers), so the transports are fingerprinted
greedy, and sampled SSD with the speculator served in process, every build complete (as
``tests/dist_harness.in_process``). The sha1 of every output's token ids (with the case that made it) is
printed: a change that keeps behaviour keeps it.

    python3 -m tests.seeded_fingerprint          # the hash; -v: each case's own hash too
"""
from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import torch

from saguaro import LLM, SamplingParams
from tests.eagle_heads import random_head_state, write_head
from tests.tiny import PROMPTS, tiny_model, truncated

MAX_TOKENS = 20
PARAMS = {"greedy": [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS),
          "t1": [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS) for i in range(len(PROMPTS))]}
COMMON = dict(block_size=4, num_speculative_tokens=3, dtype="float32", worker_timeout_s=120)


def cases(head_dir: str) -> dict[str, dict]:
    """Each case's LLM keywords beside the target (``draft``: "model", "head" or None; ``in_process``: the
    speculator served in this process, sampled too; other SSD cases run greedy only)."""
    ssd = dict(mode="ssd", fan_out=[2, 2, 2, 4])
    return {"ar": dict(mode="ar"),
            "sd-model": dict(mode="sd", draft="model"),
            "sd-ngram": dict(mode="sd", proposer="ngram"),
            "sd-eagle": dict(mode="sd", draft="head"),
            "ssd-model-thread": dict(ssd, draft="model", speculator_transport="thread"),
            "ssd-model-process": dict(ssd, draft="model", speculator_transport="process"),
            "ssd-eagle-thread": dict(ssd, draft="head", speculator_transport="thread"),
            "ssd-eagle-process": dict(ssd, draft="head", speculator_transport="process"),
            "ssd-model-inproc": dict(ssd, draft="model", speculator_transport="thread", in_process=True),
            "ssd-eagle-inproc": dict(ssd, draft="head", speculator_transport="thread", in_process=True),
            # bf16: the CPU kernels' fast path (the target's taps, the draft's fast path)
            # a target sharded over 2 ranks (spawned processes, Gloo)
            "tp2-ar": dict(mode="ar", tensor_parallel_size=2),
            "tp2-sd-model": dict(mode="sd", draft="model", tensor_parallel_size=2),
            "tp2-ssd-model-thread": dict(ssd, draft="model", speculator_transport="thread", tensor_parallel_size=2),
            "bf16-ar": dict(mode="ar", dtype="bfloat16"),
            "bf16-sd-model": dict(mode="sd", draft="model", dtype="bfloat16"),
            "bf16-sd-eagle": dict(mode="sd", draft="head", dtype="bfloat16"),
            "bf16-ssd-model-thread": dict(ssd, draft="model", speculator_transport="thread", dtype="bfloat16"),
            "bf16-ssd-eagle-thread": dict(ssd, draft="head", speculator_transport="thread", dtype="bfloat16"),
            "bf16-ssd-model-inproc": dict(ssd, draft="model", speculator_transport="thread", dtype="bfloat16",
                                          in_process=True),
            "bf16-ssd-eagle-inproc": dict(ssd, draft="head", speculator_transport="thread", dtype="bfloat16",
                                          in_process=True)}


def outputs(head_dir: str, verbose: bool = False) -> dict[str, list[list[int]]]:
    """Every case's token ids, per sampling kind (``"case/kind"``)."""
    target = tiny_model(seed=3, layers=4, sharpness=3.0)
    drafts = {"model": truncated(target, 1), "head": head_dir, None: None}
    out = {}
    for name, kw in cases(head_dir).items():
        kw = dict(kw)
        draft, inproc = drafts[kw.pop("draft", None)], kw.pop("in_process", False)
        with LLM(target=target, draft=draft, **{**COMMON, **kw}) as llm:
            if inproc:
                serve_in_process(llm, head_dir if draft == head_dir else None)
            for kind, params in PARAMS.items():
                if kind == "greedy" or kw["mode"] != "ssd" or inproc:
                    with torch.inference_mode():  # as the transports serve (an EAGLE head's feature log)
                        out[f"{name}/{kind}"] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        if verbose:
            print(name, *(digest({k: v}) for k, v in out.items() if k.startswith(name + "/")), flush=True)
    return out


def serve_in_process(llm: LLM, head_dir: str | None) -> None:
    """Swap the SSD decoder's link for the in-process one (as ``tests/dist_harness.in_process``, for a head too)."""
    from saguaro.ssd.in_process import InProcessLink
    link = llm.engine.decoder.link
    link.stop()
    draft = llm.draft
    if head_dir is not None:
        from saguaro.eagle.draft import EagleDraft
        draft = EagleDraft(head_dir, llm.target.config, llm.target.model.model.embed_tokens.weight)
    llm.engine.decoder.link = InProcessLink(draft, link.opts)


def digest(results: dict[str, list[list[int]]]) -> str:
    h = hashlib.sha1()
    for key in sorted(results):
        h.update(f"{key}:{results[key]}\n".encode())
    return h.hexdigest()


def fingerprint(verbose: bool = False) -> str:
    target = tiny_model(seed=3, layers=4, sharpness=3.0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, state = random_head_state(target, draft_vocab=48, seed=1)
        head_dir = str(write_head(Path(tmp) / "eagle", cfg, state, "midlayer"))
        return digest(outputs(head_dir, verbose))


if __name__ == "__main__":
    print(fingerprint(verbose="-v" in sys.argv[1:]))
