"""Engine configuration: one self-validating dataclass for every mode.

Validation only validates: it reads no file. An "auto" setting stays "auto" here; whoever builds the
engine resolves it from the pair's calibration profile (``saguaro.calibration.resolve``, called by ``LLM``).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

from saguaro.models.draft_format import DraftFormat
from saguaro.placement import check_transport, gpu_index, place_speculator

MODES = ("ar", "sd", "ssd")
PROPOSERS = ("draft", "ngram")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
WORKLOADS = ("mixed", "code", "chat")  # which held-out prompts a calibration profile was measured on


@dataclass
class Config:
    target: str
    draft: str | None = None
    mode: str = "ar"
    proposer: str = "draft"  # SD proposer: the draft model or the n-gram matcher
    num_speculative_tokens: int | str = 4  # K, or "auto": the calibration profile's best K (resolved by LLM)
    fan_out: list[int] | str | None = None  # SSD: F_0..F_K, or "auto" from a calibration profile
    fallback: str = "jit"  # SSD cache-miss fallback: "jit" (primary drafts), "ngram", "random", or "auto"
    saguaro_c: float | str = 1.0  # SSD: Saguaro sampling down-weighting constant C in [0, 1], or "auto"
    branch_steps: int | str | None = None  # SSD: steps decoding every branch (None: K; fewer: tapered), or "auto"
    deep_branches: int = 1  # SSD: the likeliest branches that go on past branch_steps, up to K tokens
    dtype: str = "auto"  # "auto": the checkpoint's own dtype (saguaro.loading.dtype), e.g. bf16 for the Qwen files
    device: str = "cpu"  # "cpu" or "cuda:N" for the target
    draft_device: str | None = None  # SSD: the draft's device; default the CPU, else the next GPU, else the target's
    speculator_transport: str = "auto"  # SSD: "process", "thread" (in the target's process) or "auto" (placement.py)
    threads: int = 1  # torch threads per process
    target_cores: list[int] | None = field(default_factory=lambda: [0])  # CPU affinity of the target process
    draft_cores: list[int] | None = field(default_factory=lambda: [1])  # CPU affinity of the SSD worker
    block_size: int = 16
    kv_cache_tokens: int = 32768  # capacity of each model's paged KV cache
    max_num_seqs: int = 16
    max_prefill_tokens: int = 4096
    max_model_len: int | None = None  # defaults to the model's context length
    enforce_eager: bool = False  # run the exact eager reference instead of the device's fast path (tests)
    compile: bool | None = None  # deprecated alias: compile=True is the default, compile=False is enforce_eager
    speculator: str | None = None  # deprecated alias of proposer ("speculator" names the SSD draft side)
    draft_weights: str = "bf16"  # "int8"/"int4": the draft runs W8A8/W4A8 on the fast path (cheaper, still lossless)
    draft_vocab: int | None = None  # the draft head keeps token ids below this (plus special tokens)
    worker_timeout_s: float = 60.0  # SSD: a worker silent this long is declared dead
    calibration_workload: str = "mixed"  # which profile "auto" reads: "mixed", "code" or "chat" (saguaro calibrate)

    def __post_init__(self) -> None:
        if self.compile is not None:
            warnings.warn("Config(compile=...) is deprecated: the fast path is the default and enforce_eager=True "
                          "turns it off", DeprecationWarning, stacklevel=3)
            self.enforce_eager = not self.compile
            self.compile = None
        if self.speculator is not None:
            warnings.warn("Config(speculator=...) is deprecated: the SD proposer is proposer='draft' or 'ngram'",
                          DeprecationWarning, stacklevel=3)
            self.proposer, self.speculator = self.speculator, None
        check_workload(self.calibration_workload, "calibration_workload")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        k = self.num_speculative_tokens  # "auto": checked against K once it is resolved (calibration.resolve)
        if k == "auto" and not self.draft:
            raise ValueError('num_speculative_tokens="auto" needs a draft model and a calibration profile')
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.mode != "ar" and k != "auto" and k < 1:
            raise ValueError(f"num_speculative_tokens (K) must be >= 1, got {k}")
        needs_draft = self.mode == "ssd" or (self.mode == "sd" and self.proposer == "draft")
        if needs_draft and not self.draft:
            raise ValueError(f"mode {self.mode!r} with the draft proposer needs a draft model (draft=...)")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        for name in ("block_size", "kv_cache_tokens", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        c = self.saguaro_c
        if c != "auto" and not (isinstance(c, (int, float)) and 0.0 <= c <= 1.0):
            raise ValueError(f"saguaro_c must be in [0, 1], got {self.saguaro_c}")
        if self.fallback not in ("jit", "ngram", "random", "auto"):
            raise ValueError(f"fallback must be jit, ngram, random or auto, got {self.fallback!r}")
        if isinstance(self.fan_out, list):
            if k != "auto" and len(self.fan_out) != k + 1:
                raise ValueError(f"fan_out needs K+1 = {k + 1} entries, got {len(self.fan_out)}")
            if any(f < 0 for f in self.fan_out):
                raise ValueError(f"fan_out entries must be >= 0, got {self.fan_out}")
        elif self.fan_out not in (None, "auto"):
            raise ValueError(f"fan_out must be a list of K+1 ints, 'auto' or None, got {self.fan_out!r}")
        steps = self.branch_steps
        if steps not in (None, "auto") and (not isinstance(steps, int) or steps < 1 or (k != "auto" and steps > k)):
            raise ValueError(f"branch_steps must lie in [1, K = {k}], got {steps}")
        if self.deep_branches < 1:
            raise ValueError(f"deep_branches must be >= 1, got {self.deep_branches}")
        self.draft_format  # validates draft_weights / draft_vocab
        check_device(self.device)
        if self.draft_device is not None:
            check_device(self.draft_device)
        self._place_speculator()
        for cores in (self.target_cores, self.draft_cores):
            if cores is not None:
                bad = [c for c in cores if not 0 <= c < (os.cpu_count() or 1)]
                if bad:
                    raise ValueError(f"CPU cores {bad} do not exist (this machine has {os.cpu_count()})")

    def _place_speculator(self) -> None:
        """SSD: resolve draft_device and speculator_transport (saguaro.placement), or refuse what cannot work."""
        check_transport(self.speculator_transport)
        if self.mode != "ssd":
            return
        on_gpu = any(d is not None and gpu_index(d) is not None for d in (self.device, self.draft_device))
        placement = place_speculator(self.device, self.draft_device, torch.cuda.device_count() if on_gpu else 0,
                                     self.speculator_transport)
        self.draft_device, self.speculator_transport = placement.draft_device, placement.transport

    @property
    def graph_rows(self) -> int:
        """The most rows of a target (or SD draft) pass that replays a CUDA graph: a decode or a K+1-row
        verification of every sequence at once. Larger passes (prefills) run eagerly."""
        k = self.num_speculative_tokens if isinstance(self.num_speculative_tokens, int) else 0
        return self.max_num_seqs * (1 if self.mode == "ar" else k + 1)

    @property
    def fast(self) -> bool:
        """The device's fast path: CUDA graphs over fused kernels on a GPU, the bf16 kernels on a CPU."""
        return not self.enforce_eager

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":  # LLM resolves it from the checkpoint before anything runs (no I/O here)
            raise ValueError('dtype "auto" is resolved from the checkpoint when the engine loads it; '
                             "name a dtype to use this Config on its own")
        return DTYPES[self.dtype]

    @property
    def draft_format(self) -> DraftFormat:
        return DraftFormat(self.draft_weights, self.draft_vocab)

    @property
    def draft_torch_dtype(self) -> torch.dtype:
        """The draft's dtype: the engine's, or bf16 for an int8 / int4 / reduced-head draft."""
        return self.draft_format.dtype(self.torch_dtype)


def check_workload(workload: str, name: str = "calibration workload") -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"{name} must be one of {WORKLOADS}, got {workload!r}")


def check_device(device: str) -> None:
    """Refuse a device that is not there, with a clear message."""
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} GPU(s) are present")
