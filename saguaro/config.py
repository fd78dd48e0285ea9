"""Engine configuration: one self-validating dataclass for every mode.

Validation only validates: it reads no file. An "auto" setting stays "auto" here; whoever builds the
engine resolves it from the pair's calibration profile (``saguaro.calibration.resolve``, called by ``LLM``).
"""
from __future__ import annotations

import os
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from saguaro.adapt_settings import AdaptSettings
from saguaro.cores import default_draft_cores, default_target_cores
from saguaro.engine.prefill_chunks import check_chunking
from saguaro.models.draft_format import WEIGHT_FORMATS, DraftFormat
from saguaro.placement import check_transport, gpu_index, place_speculator
from saguaro.removed import refuse_options
from saguaro.ssd_settings import SETTINGS, SSDSettings

MODES = ("ar", "sd", "ssd")
PROPOSERS = ("draft", "ngram")
DRAFT_KINDS = ("auto", "model", "eagle3")  # "auto": an EAGLE-3 head when the draft directory holds one
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
WORKLOADS = ("mixed", "code", "chat")  # which held-out prompts a calibration profile was measured on


class _Unset:
    def __repr__(self) -> str:
        return "<not given: see Config.ssd>"


_UNSET: Any = _Unset()  # a flat SSD setting that was not given (read the value from Config.ssd)


@dataclass
class Config:
    target: str
    draft: str | None = None
    mode: str = "ar"
    proposer: str = "draft"  # SD proposer: the draft model or the n-gram matcher
    num_speculative_tokens: int | str = 4  # K, or "auto": the calibration profile's best K (resolved by LLM)
    ssd: SSDSettings = field(default_factory=SSDSettings)  # fan-outs, miss strategy, C, the tree's taper
    dtype: str = "auto"  # "auto": the checkpoint's own dtype (saguaro.loading.dtype), e.g. bf16 for the Qwen files
    device: str = "cpu"  # "cpu" or "cuda:N" for the target
    draft_device: str | None = None  # SSD: the draft's device; default the CPU, else the next GPU, else the target's
    speculator_transport: str = "auto"  # SSD: "process", "thread" (in the target's process) or "auto" (placement.py)
    threads: int = 1  # torch threads per process
    # CPU affinity of the target process and of the SSD worker: by default the first two usable cores
    # (``cores.usable_cores``: SAGUARO_CORES, else the cores this process may run on)
    target_cores: list[int] | None = field(default_factory=default_target_cores)
    draft_cores: list[int] | None = field(default_factory=default_draft_cores)
    block_size: int = 16
    kv_cache_tokens: int = 32768  # capacity of each model's paged KV cache
    max_num_seqs: int = 16
    max_prefill_tokens: int | str = "auto"  # prompt tokens per prefill step; "auto": sized by time (prefill_chunks)
    prefill_step_budget_s: float | None = None  # "auto"'s time per prefill step (default 0.25 s CPU, 25 ms GPU)
    max_model_len: int | None = None  # defaults to the model's context length
    enforce_eager: bool = False  # run the exact eager reference instead of the device's fast path (tests)
    draft_weights: str = "bf16"  # "int8"/"int4": the draft runs W8A8/W4A8 on the fast path (cheaper, still lossless)
    # "int8"/"int4": the target itself quantized on the CPU kernels, a smaller model as a Q8/Q4 GGUF is; AR, SD
    # and SSD then all give that model's output (SD and SSD exact to it)
    target_weights: str = "bf16"
    draft_vocab: int | None = None  # the draft head keeps token ids below this (plus special tokens)
    # a worker (the SSD speculator, a process or thread; a tensor-parallel rank) silent this long is declared dead
    worker_timeout_s: float = 60.0
    calibration_workload: str = "mixed"  # which profile "auto" reads: "mixed", "code" or "chat" (saguaro calibrate)
    tensor_parallel_size: int = 1  # the target's devices (ranks): >1 shards it with torch.distributed (parallel/)
    draft_kind: str = "auto"  # the draft: a model, an EAGLE-3 head directory (SD, SSD), or "auto" to tell them apart
    # SD, SSD: each request's K chosen every round, 0 (AR) to num_speculative_tokens (saguaro.adapt); False: fixed K
    adaptive: bool = True
    adapt: AdaptSettings = field(default_factory=AdaptSettings)
    # the flat spellings of ``ssd``'s fields (SSDSettings), as LLM(...) and the CLI take them
    fan_out: InitVar[list[int] | str | None] = _UNSET
    miss_strategy: InitVar[str] = _UNSET
    saguaro_c: InitVar[float | str] = _UNSET
    branch_steps: InitVar[int | str | None] = _UNSET
    deep_branches: InitVar[int] = _UNSET

    def __new__(cls, *args: Any, **kwargs: Any) -> "Config":
        refuse_options(kwargs)  # a removed spelling names its replacement (saguaro.removed)
        return super().__new__(cls)

    def __post_init__(self, *flat: Any) -> None:
        self._gather_ssd(dict(zip(SETTINGS, flat)))
        check_workload(self.calibration_workload, "calibration_workload")
        if isinstance(self.adapt, dict):
            self.adapt = AdaptSettings(**self.adapt)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        k = self.num_speculative_tokens  # "auto": checked against K once it is resolved (calibration.resolve)
        if k == "auto" and not self.draft:
            raise ValueError('num_speculative_tokens="auto" needs a draft model and a calibration profile')
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"draft_kind must be one of {DRAFT_KINDS}, got {self.draft_kind!r}")
        if self.draft_kind == "eagle3":
            self.check_eagle3()
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.mode != "ar" and k != "auto" and k < 1:
            raise ValueError(f"num_speculative_tokens (K) must be >= 1, got {k}")
        needs_draft = self.mode == "ssd" or (self.mode == "sd" and self.proposer == "draft")
        if needs_draft and not self.draft:
            raise ValueError(f"mode {self.mode!r} with the draft proposer needs a draft model (draft=...)")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        check_chunking(self.max_prefill_tokens, self.prefill_step_budget_s)
        for name in ("block_size", "kv_cache_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if k != "auto":
            self.ssd.check_k(k)
        self.draft_format  # validates draft_weights / draft_vocab
        self._check_target_weights()
        check_device(self.device)
        if self.draft_device is not None:
            check_device(self.draft_device)
        self._place_speculator()
        for cores in (self.target_cores, self.draft_cores):
            if cores is not None:
                bad = [c for c in cores if not 0 <= c < (os.cpu_count() or 1)]
                if bad:
                    raise ValueError(f"CPU cores {bad} do not exist (this machine has {os.cpu_count()})")

    def _check_target_weights(self) -> None:
        """A quantized target exists only as CPU kernels, on one device."""
        if self.target_weights not in WEIGHT_FORMATS:
            raise ValueError(f"target_weights must be one of {WEIGHT_FORMATS}, got {self.target_weights!r}")
        if self.target_weights == "bf16":
            return
        if gpu_index(self.device) is not None:
            raise ValueError(f"target_weights={self.target_weights!r} runs on the CPU kernels: use device='cpu'")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"target_weights={self.target_weights!r} is not sharded: use tensor_parallel_size=1")
        if self.enforce_eager:
            raise ValueError(f"target_weights={self.target_weights!r} exists only on the CPU kernels, and "
                             "enforce_eager=True runs the eager reference")

    def check_eagle3(self, head: str = "an EAGLE-3 draft") -> None:
        """Refuse what an EAGLE-3 head cannot do (``head`` names it in the message)."""
        if self.mode not in ("sd", "ssd"):
            raise ValueError(f"{head} drafts in mode='sd' or mode='ssd', not {self.mode!r}")
        if self.mode == "sd" and self.proposer != "draft":
            raise ValueError(f"{head} is the draft proposer: proposer={self.proposer!r} drafts without it")
        if self.draft_format.custom:
            raise ValueError(f"draft_weights / draft_vocab shape a draft model's weights, not {head}'s")

    def _gather_ssd(self, flat: dict[str, Any]) -> None:
        """Map the flat SSD keyword arguments into ``ssd`` (validated there, once)."""
        given = {name: value for name, value in flat.items() if value is not _UNSET}
        if given:
            if self.ssd != SSDSettings():
                raise ValueError(f"give the SSD settings either as ssd=SSDSettings(...) or flat, not both: {given}")
            self.ssd = SSDSettings(**given)

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
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":  # LLM resolves it from the checkpoint before anything runs (no I/O here)
            raise ValueError('dtype "auto" is resolved from the checkpoint when the engine loads it; '
                             "name a dtype to use this Config on its own")
        return DTYPES[self.dtype]

    @property
    def target_torch_dtype(self) -> torch.dtype:
        """The target's dtype: the engine's, or bf16 for an int8 / int4 target (packed from bf16 weights)."""
        return self.torch_dtype if self.target_weights == "bf16" else torch.bfloat16

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
