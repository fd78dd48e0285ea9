"""The speculator's host: what it needs (``SpeculatorOptions``), how it starts (``start_speculator``) and how
it serves its requests (``serve``), whatever carries them.

Every transport -- the process (``worker.py``), the thread (``thread_link.py``) and the synchronous
in-process link (``in_process.py``) -- starts the speculator and serves it through these, and differs
only in how requests reach it and responses leave it.

Serving, per request: a stop ends it; a prefill is taken (its tokens are fed later) and gets no response; a
round is answered (``respond``; a quiet round, whose every K is 0, is applied the same way and its empty
answer is not sent) and then the next cache is built until a request other than a prefill is
waiting (``Inbox.interrupted``: a prefill arriving meanwhile waits, and the build goes on). In the idle time
after that -- the build done, no request waiting -- the pending prefill is fed a piece at a time
(``prefill_work.py``), so a long prompt's prefill never delays a round's response nor cuts a build short.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from saguaro.config import Config
from saguaro.drafts import SpeculatorDraft, as_draft
from saguaro.loading import LoadedModel
from saguaro.models.draft_format import DraftFormat
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import CMD_PREFILL, CMD_QUIET, CMD_STOP, RoundRequest, RoundResponse
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
    max_model_len: int | None = None  # the longest sequence (bounds the block tables its graphs stage)

    @classmethod
    def from_config(cls, cfg: Config, plan: SpecPlan) -> SpeculatorOptions:
        return cls(plan=plan, dtype=cfg.draft_torch_dtype, device=cfg.draft_device or cfg.device,
                   cores=cfg.draft_cores, threads=cfg.threads, kv_cache_tokens=cfg.kv_cache_tokens,
                   block_size=cfg.block_size, timeout_s=cfg.worker_timeout_s, enforce_eager=cfg.enforce_eager,
                   draft_format=cfg.draft_format, max_num_seqs=cfg.max_num_seqs,
                   max_model_len=cfg.max_model_len)

    @property
    def k(self) -> int:
        return self.plan.k

    def graph_rows(self) -> int:
        """The most rows one draft pass can have: every sequence of the largest batch, each with the widest tree
        the plan gives it (or a K+1-token catch-up)."""
        return self.max_num_seqs * max(self.widest_tree() + 1, self.k + 1)

    def widest_tree(self) -> int:
        """The most branches a sequence's cache can have, over every tree the plan offers."""
        return max(sum(f) for f in self.plan.lists())

    def draft_blocks(self) -> int:
        """Room for every sequence's context (as many tokens as the target's cache holds) plus the branch scratch
        of a full batch: as much again, or each sequence's K steps over the plan's widest tree where that is more
        (a wide tree over a small cache once ran the speculator out of blocks). A batch holds at most
        ``max_num_seqs`` sequences, and no more than the target's cache has blocks."""
        contexts = math.ceil(self.kv_cache_tokens / self.block_size)
        seqs = min(self.max_num_seqs, contexts)
        return contexts + max(contexts, seqs * math.ceil(self.k * self.widest_tree() / self.block_size))


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
        speculator.prefill(request)  # taken only: fed while idle (``prefill_work.py``)
        return True
    response = speculator.respond(request)
    if request.command != CMD_QUIET:
        reply(response)
    speculator.build(interrupted=interrupted)
    return True


class Inbox:
    """The transport's requests in the order the speculator serves them. A prefill that arrives during a build
    waits here without cutting the build short; any other request does cut it short (``interrupted``)."""

    def __init__(self, receive: Callable[[], RoundRequest | None], waiting: Callable[[], bool]):
        self._receive, self._waiting = receive, waiting
        self.held: deque[RoundRequest | None] = deque()  # taken from the transport, not yet served

    def take(self) -> RoundRequest | None:
        """The next request to serve, waiting for one if need be; None once the other side is gone."""
        return self.held.popleft() if self.held else self._receive()

    def interrupted(self) -> bool:
        """Is a request other than a prefill waiting (or the other side gone)? Prefills are taken in meanwhile."""
        while not self._stops() and self._waiting():
            self.held.append(self._receive())
        return self._stops()

    def _stops(self) -> bool:
        return any(r is None or r.command != CMD_PREFILL for r in self.held)

    def waiting(self) -> bool:
        """Is any request waiting?"""
        return bool(self.held) or self._waiting()


def serve(speculator: Speculator, receive: Callable[[], RoundRequest | None],
          reply: Callable[[RoundResponse], None], interrupted: Callable[[], bool]) -> None:
    """Serve requests until the stop, or until ``receive`` finds the other side gone (None); then close. In the
    idle time between them (the build done, nothing waiting) feed the pending prefill, one piece at a time."""
    inbox = Inbox(receive, interrupted)
    try:
        while (request := inbox.take()) is not None and handle(speculator, request, reply, inbox.interrupted):
            while not inbox.waiting() and speculator.prefill_piece():
                pass
    finally:
        speculator.close()
