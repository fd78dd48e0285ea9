"""``saguaro info``: this CPU's features, the kernel tier each model of the demo pair runs on and why, the
pair's one-core memory floor, and its expected resident footprint.

The floor: a decode step streams every packed weight once, so one token of a model costs at least its
packed bytes / the bandwidth one core streams (a sum over a huge-page buffer, ``calibration/bus.py``).

The footprint: after loading, a process holds its packed arena (the one copy of its matrices), the KV cache
blocks its requests wrote (allocated untouched: ``kv/``) and the runtime (Python, torch, Saguaro: this
process's resident memory before it loads a model). SSD runs the draft in a process of its own, so the demo's
SSD holds two runtimes. ``saguaro bench peers --memory`` measures the real figure.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels.model import pass_bytes, unsupported_reason
from saguaro.models.draft_format import DraftFormat

DEMO_CONTEXT = 4096  # the demo's max_model_len
FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c", "asimd")


@dataclass(frozen=True)
class ModelLine:
    role: str          # "target" or "draft"
    name: str
    weights: str       # packed format: "bf16", "int8", "int4" (+ head size)
    path: str          # "cpu_kernels/<tier>" or "eager"
    why: str
    bytes_per_token: int
    kv_bytes_per_token: int  # bf16 keys and values of every layer


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Model"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_line(role: str, name: str, fmt: DraftFormat) -> ModelLine:
    """Which path ``name`` (loaded in bf16, as the demo runs it) takes with ``fmt``, and its bytes per token."""
    from saguaro.loading import load_model
    loaded = load_model(name, torch.bfloat16, progress=False)
    head = fmt.head_ids(loaded)
    rows = loaded.config.vocab_size if head is None else len(head)
    label = fmt.weights + ("" if head is None else f", head {rows} of {loaded.config.vocab_size}")
    reason = unsupported_reason(loaded.model, fmt.weights)
    if reason is None:
        tier = kernels.chosen_tier()
        path, why = f"cpu_kernels/{tier}", kernels.why(tier)
    else:
        path, why = "eager", reason
    cfg = loaded.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return ModelLine(role, name, label, path, why, pass_bytes(cfg, fmt.weights, rows), kv)


def footprint(models: list[ModelLine], runtime_bytes: int, context: int = DEMO_CONTEXT) -> str:
    """The demo SSD's expected resident memory: packed arenas, KV caches full to ``context`` tokens, and one
    runtime per process (the target's and the speculator's)."""
    arenas = sum(m.bytes_per_token for m in models)
    kv = sum(m.kv_bytes_per_token for m in models) * context
    total = arenas + kv + len(models) * runtime_bytes
    return (f"expected footprint of the demo's SSD ({len(models)} processes): {arenas / 1e9:.2f} GB packed weights "
            f"+ {kv / 1e9:.2f} GB KV cache ({context} tokens) + {len(models)} x {runtime_bytes / 1e9:.2f} GB "
            f"runtime = about {total / 1e9:.2f} GB resident (measure: saguaro bench peers --memory)")


def read_plan(tier: str) -> str | None:
    """How the avx2 tier reads one row's weights on this CPU (``stream_tune.py``); None for other tiers."""
    if tier != "avx2":
        return None
    from saguaro.backends.cpu_kernels import stream_tune
    streams, bf16_bytes, blocks = kernels.load(tier).row_reads()
    return (f"avx2 row reads: {streams} bf16 stream(s), {bf16_bytes} bytes prefetched ahead; int8/int4 {blocks} "
            f"block(s) ahead (measured once for this CPU; {stream_tune.ENV} sets it)")


def one_core_bandwidth(seconds: float = 2.0) -> float:
    """Bytes per second core 0 streams alone (one window of ``seconds``)."""
    from saguaro.calibration.bus import stream_rates
    return stream_rates([0], seconds)[0]


def report(target: str, draft: str, draft_format: DraftFormat) -> str:
    from saguaro.host_memory import resident_bytes
    runtime = resident_bytes()  # before any model is loaded
    flags = kernels.cpu_flags()
    have = [f for f in FEATURES if f in flags]
    lines = [f"CPU: {cpu_name()} ({platform.machine()}, {os.cpu_count()} cores), "
             f"features: {' '.join(have) or 'none of ' + ' '.join(FEATURES)}",
             f"kernel tiers this CPU executes: {', '.join(kernels.runnable_tiers())} "
             f"(force one with {kernels.ENV}=avx512|avx2|portable)"]
    if plan := read_plan(kernels.chosen_tier()):
        lines.append(plan)
    models = [model_line("target", target, DraftFormat()), model_line("draft", draft, draft_format)]
    bandwidth = one_core_bandwidth()
    for m in models:
        floor = m.bytes_per_token / bandwidth
        lines.append(f"{m.role:6s} {m.name}: {m.weights}; {m.path} ({m.why}); {m.bytes_per_token / 1e9:.3f} GB per "
                     f"token, floor {floor * 1e3:.1f} ms ({1 / floor:.1f} tok/s)")
    lines.append(footprint(models, runtime))
    lines.append(f"one-core bandwidth: {bandwidth / 1e9:.1f} GB/s (sum over 1 GiB in huge pages, core 0)")
    return "\n".join(lines)
