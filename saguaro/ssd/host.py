"""The speculator's host: what it needs (``SpeculatorOptions``), how it starts (``start_speculator``) and how
it serves its requests (``serve``), whatever carries them.

Every transport -- the process (``worker.py``), the thread (``thread_link.py``) and the synchronous
in-process link (``in_process.py``) -- starts the speculator and serves it through these, and differs
only in how requests reach it and responses leave it.

Serving, per request: a stop ends it; a prefill fills the draft cache and gets no response (a build it
cut short stays as it is); a round is answered (``respond``) and then the next cache is built until the
transport says the next request is waiting (``interrupted``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from saguaro.config import Config
from saguaro.drafts import SpeculatorDraft, as_draft
from saguaro.loading import LoadedModel
from saguaro.models.draft_format import DraftFormat
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import CMD_PREFILL, CMD_STOP, RoundRequest, RoundResponse
from saguaro.ssd.ranks import RankRecorder, RecordingSpeculator
from saguaro.ssd.speculator import Speculator


@dataclass(kw_only=True)
class SpeculatorOptions:
    """What the speculator needs: its plan, and where and how its draft runs (``from_config``)."""
    plan: SpecPlan  # K, fan-outs, Saguaro C, the miss strategy and the tree's taper
    dtype: torch.dtype  # the draft's
    device: str
    cores: list[int] | None  # CPU affinity of the speculator (its process, or its thread)
    threads: int
    kv_cache_tokens: int
    block_size: int
    timeout_s: float  # a side silent this long is declared dead
    enforce_eager: bool = True  # False: the draft runs the device's fast path, like the target (Config)
    draft_format: DraftFormat = field(default_factory=DraftFormat)  # int8 weights / reduced head
    max_num_seqs: int = 1  # the largest batch a round can carry (sizes the draft's CUDA graphs)

    @classmethod
    def from_config(cls, cfg: Config, plan: SpecPlan) -> SpeculatorOptions:
        return cls(plan=plan, dtype=cfg.draft_torch_dtype, device=cfg.draft_device or cfg.device,
                   cores=cfg.draft_cores, threads=cfg.threads, kv_cache_tokens=cfg.kv_cache_tokens,
                   block_size=cfg.block_size, timeout_s=cfg.worker_timeout_s, enforce_eager=cfg.enforce_eager,
                   draft_format=cfg.draft_format, max_num_seqs=cfg.max_num_seqs)

    @property
    def k(self) -> int:
        return self.plan.k

    def graph_rows(self) -> int:
        """The most rows one draft pass can have: every sequence of the largest batch, each with the widest tree
        the plan gives it (or a K+1-token catch-up)."""
        widest = max(sum(f) for f in self.plan.lists())  # over every tree the plan offers
        return self.max_num_seqs * max(widest + 1, self.k + 1)

    def draft_blocks(self) -> int:
        """Room for every sequence's context plus the branch scratch of a full batch."""
        return math.ceil(self.kv_cache_tokens / self.block_size) * 2


def start_speculator(draft: SpeculatorDraft | LoadedModel | str, opts: SpeculatorOptions,
                     recorder: RankRecorder | None = None) -> Speculator:
    """The draft's runner on the speculator's device (``speculator_runner`` of its kind: a model loaded or
    placed, an EAGLE-3 head built), and the engine's speculator over it -- or with ``recorder``, calibration's,
    which records bonus-token ranks.

    The draft's graphs are captured before the speculator serves (a GPU's paged backend; nothing elsewhere):
    every row bucket a tree step can reach, for every width of its extra slots (tree step j reads j + 1), so
    that no round captures, and the speculator never captures beside the target. The build graphs too
    (``Speculator.capture_builds``)."""
    runner = as_draft(draft).speculator_runner(opts)
    runner.capture_graphs(opts.graph_rows(), tuple(range(opts.k + 1)))
    if recorder is not None:
        return RecordingSpeculator(runner, opts.plan, recorder)
    speculator = Speculator(runner, opts.plan)
    speculator.capture_builds(opts.max_num_seqs)  # and the build graphs, every shape a round can take
    return speculator


def never() -> bool:
    return False


def handle(speculator: Speculator, request: RoundRequest, reply: Callable[[RoundResponse], None],
           interrupted: Callable[[], bool] = never) -> bool:
    """Serve one request (see the module docstring); False once it is the stop."""
    if request.command == CMD_STOP:
        return False
    if request.command == CMD_PREFILL:
        speculator.prefill(request)
        return True
    reply(speculator.respond(request))
    speculator.build(interrupted=interrupted)
    return True


def serve(speculator: Speculator, receive: Callable[[], RoundRequest | None],
          reply: Callable[[RoundResponse], None], interrupted: Callable[[], bool]) -> None:
    """Serve requests until the stop, or until ``receive`` finds the other side gone (None); then close."""
    try:
        while (request := receive()) is not None and handle(speculator, request, reply, interrupted):
            pass
    finally:
        speculator.close()
