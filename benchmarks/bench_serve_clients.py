"""What code assistants send, through the real server: fill-in-the-middle, JSON-schema chats, logprobs.

One ``saguaro serve`` app per mode (AR, SD, SSD) runs in this process on loopback, and every request goes
through HTTP as a client sends it, one at a time (batch 1: latency), greedy. Each row is the median over
prompts of the decode speed the server reports (the response's ``saguaro`` block: tokens after the first,
over the time after the first), and the pooled acceptance (accepted over drafted tokens):

* FIM: HumanEval functions with a middle cut out of the canonical solution (the prompt and the solution's
  first third are the prefix, its last third the suffix), on ``/v1/completions`` with ``suffix``;
* JSON: a chat asking for a function's description as JSON, with and without ``response_format`` (a
  JSON schema), and the ratio constrained / unconstrained (goal: SSD keeps >= 0.9x);
* logprobs: HumanEval completions with ``logprobs: 5`` against none, and the ratio (goal: >= 0.95x).

The two sides of a ratio alternate request by request, so load that drifts on a shared machine hits both.

    python -m benchmarks.bench_serve_clients                       # Qwen2.5-Coder 1.5B bf16 / 0.5B int4
    python -m benchmarks.bench_serve_clients --prompts 3 --max-tokens 32
    SAGUARO_CPU_TIER=avx2 python -m benchmarks.bench_serve_clients --name bench_serve_clients_avx2
    python -m benchmarks.bench_serve_clients --shape tiny --prompts 1 --max-tokens 4 --out /tmp/x   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from benchmarks.common import add_model_args, environment, fmt, log, median, ratio, table, write_results
from saguaro import LLM, datasets
from saguaro.cli import DEMO_BRANCH_STEPS, DEMO_DRAFT_WEIGHTS, DEMO_FAN_OUT, DEMO_SD_K
from saguaro.models.draft_format import WEIGHT_FORMATS

MODES = ("ar", "sd", "ssd")
LOGPROBS = 5
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "arguments": {"type": "array", "items": {"type": "string"}},
                                           "returns": {"type": "string"}},
          "required": ["name", "arguments", "returns"], "additionalProperties": False}
JSON_REQUEST = "Describe this Python function as JSON with its name, its arguments and what it returns.\n\n"


@dataclass
class Sample:
    """One request's figures, from the response's ``saguaro`` block."""
    tok_s: float
    tokens: int
    drafted: int = 0
    accepted: int = 0
    text: str = ""


@dataclass
class Workload:
    """The samples of one workload in one mode, by side ("fim"; "free"/"json"; "off"/"on")."""
    sides: dict[str, list[Sample]] = field(default_factory=dict)

    def add(self, side: str, sample: Sample) -> None:
        self.sides.setdefault(side, []).append(sample)

    def tok_s(self, side: str) -> float | None:
        """Median decode speed over the requests with a decode (more than one token)."""
        return median(s.tok_s for s in self.sides.get(side, []) if s.tokens > 1)

    def tokens(self, side: str) -> float | None:
        samples = self.sides.get(side, [])
        return sum(s.tokens for s in samples) / len(samples) if samples else None

    def acceptance(self, side: str) -> float | None:
        samples = self.sides.get(side, [])
        drafted = sum(s.drafted for s in samples)
        return sum(s.accepted for s in samples) / drafted if drafted else None


# -- prompts ---------------------------------------------------------------------------
def fim_pairs(n: int) -> list[tuple[str, str]]:
    """(prefix, suffix) of the first ``n`` HumanEval functions: the canonical solution's middle third cut out
    (at least one line that is not blank), what an editor asks a model to fill."""
    pairs = []
    for item in datasets.humaneval_records(n):
        lines = item["canonical_solution"].splitlines(keepends=True)
        start = len(lines) // 3
        end = min(len(lines), start + max(1, len(lines) // 3))
        while end < len(lines) and not "".join(lines[start:end]).strip():  # never a blank middle
            end += 1
        pairs.append((item["prompt"] + "".join(lines[:start]), "".join(lines[end:])))
    return pairs


# -- the server ------------------------------------------------------------------------
@contextmanager
def served(llm: LLM, name: str) -> Iterator[str]:
    """``saguaro serve``'s app over ``llm`` on a free loopback port, in a thread; yields its URL."""
    from saguaro.server.in_thread import serve_in_thread
    with serve_in_thread(llm, name) as s:
        yield s.url


def post(url: str, body: dict) -> tuple[Sample, dict]:
    """POST a request; its sample and the response. A refusal raises with the server's message."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read().decode()[:500]}") from None
    choice, extra = reply["choices"][0], reply["saguaro"]
    spec = extra["speculation"] or {}
    text = choice["text"] if "text" in choice else choice["message"]["content"] or ""
    return Sample(extra["timings"]["decode_tokens_per_s"], reply["usage"]["completion_tokens"],
                  spec.get("drafted_tokens", 0), spec.get("accepted_tokens", 0), text), reply


# -- the workloads -----------------------------------------------------------------------
def run_mode(url: str, model: str, args: argparse.Namespace) -> dict[str, Workload]:
    """Every workload against one server; the first request of each kind warms it (grammar compile included)."""
    n, common = args.prompts, {"model": model, "max_tokens": args.max_tokens, "temperature": 0}
    completions, chats = url + "/v1/completions", url + "/v1/chat/completions"
    codes = datasets.humaneval(n)
    fmt_json = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA}}
    chat = lambda code, **kw: {**common, "messages": [{"role": "user", "content": JSON_REQUEST + code}], **kw}  # noqa
    post(chats, {**chat(codes[0], response_format=fmt_json), "max_tokens": 4})  # warm-up
    out = {"fim": Workload(), "json": Workload(), "logprobs": Workload()}
    for prefix, suffix in fim_pairs(n) if args.fim else []:
        out["fim"].add("fim", post(completions, {**common, "prompt": prefix, "suffix": suffix})[0])
        log(f"  fim: {sample_line(out['fim'], 'fim')}")
    for code in codes:
        out["json"].add("free", post(chats, chat(code))[0])
        sample, _ = post(chats, chat(code, response_format=fmt_json))
        out["json"].add("json", sample)
        out["logprobs"].add("off", post(completions, {**common, "prompt": code})[0])
        sample, reply = post(completions, {**common, "prompt": code, "logprobs": LOGPROBS})
        assert len(reply["choices"][0]["logprobs"]["token_logprobs"]) == sample.tokens
        out["logprobs"].add("on", sample)
        log(f"  prompt {len(out['json'].sides['json'])}/{n}: json {sample_line(out['json'], 'json')}, "
            f"logprobs {sample_line(out['logprobs'], 'on')}")
    log(f"  json valid: {sum(valid_json(s.text) for s in out['json'].sides['json'])}/{n}")
    return out


def sample_line(workload: Workload, side: str) -> str:
    last = workload.sides[side][-1]
    return f"{last.tokens} tokens at {last.tok_s:.2f} tok/s"


def valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# -- models and engines -----------------------------------------------------------------
def tiny_pair() -> tuple[Any, Any]:
    """Random weights of the tiny shape with a byte-level BPE tokenizer that has the FIM markers, an end of
    text and a chat template (the smoke test's pair: what the server needs, at no cost)."""
    import dataclasses

    import torch
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from benchmarks.synthetic import layer_skip_draft, random_model
    from saguaro.loading.tokenizer import Tokenizer
    from saguaro.server.fim import MARKERS
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_end|>", *MARKERS]
    backend.train_from_iterator(datasets.humaneval(20), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = Tokenizer(backend, [backend.token_to_id("<|endoftext|>")], chat_template=template)
    target = random_model("tiny", dtype=torch.float32)
    target = dataclasses.replace(target, tokenizer=tok)
    return target, dataclasses.replace(layer_skip_draft(target, 2), tokenizer=tok)


def engines(args: argparse.Namespace) -> Iterator[tuple[str, LLM]]:
    """(mode, LLM) for each asked mode, made when reached: the demo's settings (SD at K = 5, SSD at the demo's
    tapered fan-out, the draft in ``--draft-weights``)."""
    common: dict[str, Any] = dict(max_model_len=1024) if args.shape == "tiny" else dict(
        dtype="bfloat16", threads=1, max_model_len=4096, kv_cache_tokens=8192)
    for mode in args.modes:
        log(f"{mode}: loading")
        # a fresh tiny pair per engine: a tokenizer that rendered a chat holds its compiled template, which the
        # SSD worker's shipment cannot pickle
        target, draft = tiny_pair() if args.shape == "tiny" else (args.target, args.draft)
        spec = dict(draft=draft, draft_weights=args.draft_weights, **common)
        if mode == "ar":
            yield mode, LLM(target, **common)
        elif mode == "sd":
            yield mode, LLM(target=target, mode="sd", num_speculative_tokens=DEMO_SD_K, **spec)
        else:
            yield mode, LLM(target=target, mode="ssd", num_speculative_tokens=len(DEMO_FAN_OUT) - 1,
                            fan_out=DEMO_FAN_OUT, branch_steps=DEMO_BRANCH_STEPS, **spec)


# -- the report ------------------------------------------------------------------------------
def tables(results: dict[str, dict[str, Workload]]) -> str:
    ar_fim = results.get("ar", {}).get("fim", Workload()).tok_s("fim")
    fim = [[m, fmt(w["fim"].tokens("fim"), ".1f"), fmt(w["fim"].tok_s("fim")),
            fmt(ratio(w["fim"].tok_s("fim"), ar_fim)), fmt(w["fim"].acceptance("fim"))]
           for m, w in results.items() if w["fim"].sides]
    js = [[m, fmt(w["json"].tok_s("free")), fmt(w["json"].tok_s("json")),
           fmt(ratio(w["json"].tok_s("json"), w["json"].tok_s("free"))), fmt(w["json"].acceptance("free")),
           fmt(w["json"].acceptance("json"))] for m, w in results.items()]
    lp = [[m, fmt(w["logprobs"].tok_s("off")), fmt(w["logprobs"].tok_s("on")),
           fmt(ratio(w["logprobs"].tok_s("on"), w["logprobs"].tok_s("off")))] for m, w in results.items()]
    parts = []
    if fim:
        parts += ["## Fill-in-the-middle (/v1/completions with suffix)\n",
                  table(["mode", "tokens", "tok/s", "x AR", "acceptance"], fim)]
    parts += ["\n## JSON-schema chats (goal: constrained SSD >= 0.9x unconstrained)\n",
              table(["mode", "unconstrained tok/s", "constrained tok/s", "ratio", "acceptance free",
                     "acceptance json"], js),
              f"\n## Logprobs ({LOGPROBS} per token) on against off (goal >= 0.95x)\n",
              table(["mode", "off tok/s", "on tok/s", "ratio"], lp)]
    return "\n".join(parts)


def report(args: argparse.Namespace, results: dict[str, dict[str, Workload]], load_before: tuple) -> str:
    """Write the Markdown and JSON files of the modes measured so far; the Markdown."""
    from saguaro.backends.cpu_kernels.build import chosen_tier
    from saguaro.info import cpu_name
    env = {**environment(), "cpu": cpu_name(), "tier": chosen_tier(), "loadavg_before": list(load_before)}
    pair = "random weights, tiny shape" if args.shape == "tiny" else (
        f"{args.target} (bf16) / {args.draft} ({args.draft_weights})")
    header = (f"# What code assistants send, through the server\n\n{pair}; {args.prompts} HumanEval prompts x "
              f"{args.max_tokens} tokens, greedy, one request at a time; SD K={DEMO_SD_K}, SSD fan-out "
              f"{DEMO_FAN_OUT} tapered after {DEMO_BRANCH_STEPS} steps. Medians over prompts of the decode tok/s "
              "the server reports (requests of one token have none); acceptance pooled; tokens: the mean per "
              f"request.\nCPU: {env['cpu']} ({os.cpu_count()} cores), kernel tier "
              f"{env['tier']}; load average {load_before[0]:.2f} before, {env['loadavg'][0]:.2f} after (the "
              "machine is shared: other work ran beside this).\n")
    markdown = header + "\n" + tables(results)
    payload = {"environment": env, "settings": {k: str(v) for k, v in vars(args).items()},
               "results": {m: {name: {side: [s.__dict__ for s in samples] for side, samples in w.sides.items()}
                               for name, w in ws.items()} for m, ws in results.items()}}
    write_results(args.out, args.name, payload, markdown)
    return markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--shape", choices=["real", "tiny"], default="real",
                   help="tiny: random weights of a tiny shape with a FIM tokenizer, in place of the models (smoke)")
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES))
    p.add_argument("--prompts", type=int, default=3, help="HumanEval prompts per workload (default 3)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=DEMO_DRAFT_WEIGHTS)
    p.add_argument("--no-fim", dest="fim", action="store_false", help="skip the FIM rows")
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--name", default="bench_serve_clients", help="the report's file name (without suffix)")
    args = p.parse_args(argv)
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown modes {bad}; known: {', '.join(MODES)}")
    load_before = os.getloadavg()
    results, markdown = {}, ""
    for mode, llm in engines(args):
        with llm, served(llm, "bench") as url:
            results[mode] = run_mode(url, "bench", args)
        log(f"{mode}: done")
        markdown = report(args, results, load_before)  # after each mode: a late failure keeps the rows so far
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
