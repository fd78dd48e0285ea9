"""The speculator process: its own device, its own draft model, one message each way per round.

The engine starts it (``saguaro.ssd.launch``: a fresh interpreter, the draft handed over by
name or in shared memory, every start-up wait watched), talks to it through a ``Channel`` and
stops it. A worker that dies during start-up is a ``WorkerStartError`` that says how and what to
do; one that dies or goes silent later is detected by the engine (``WorkerLink.exchange``
raises), which then finishes the requests itself.

``InProcessLink`` is the same speculator without a process: each exchange responds and then
builds the whole cache before returning (a build that is never interrupted). Calibration uses
it to record bonus-token ranks deterministically; it is not meant for speed.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from saguaro.config import Config
from saguaro.device import pin_process, place
from saguaro.engine.model_runner import ModelRunner, draft_runner
from saguaro.ssd.channel import Channel, ChannelClosed, MessageCounters, free_port
from saguaro.ssd.launch import DraftSource, WorkerProcess, parent_alive
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import (CMD_PREFILL, CMD_STOP, RoundRequest, RoundResponse, pack_request,
                                  pack_response, unpack_request, unpack_response)
from saguaro.ssd.ranks import RankRecorder, RecordingSpeculator
from saguaro.ssd.speculator import Speculator
from saguaro.models.draft_format import DraftFormat

log = logging.getLogger("saguaro.ssd")


@dataclass(kw_only=True)
class WorkerOptions:
    """What the speculator process needs: its plan, and where and how its draft runs (``from_config``)."""
    plan: SpecPlan  # K, fan-outs, Saguaro C, the fallback and the tree's taper
    dtype: torch.dtype  # the draft's
    device: str
    cores: list[int] | None  # CPU affinity of the speculator process
    threads: int
    kv_cache_tokens: int
    block_size: int
    timeout_s: float  # a side silent this long is declared dead
    fast: bool = False  # run the draft through the device's fast path (Config.fast), like the target
    draft_format: DraftFormat = field(default_factory=DraftFormat)  # int8 weights / reduced head
    max_num_seqs: int = 1  # the largest batch a round can carry (sizes the draft's CUDA graphs)

    @classmethod
    def from_config(cls, cfg: Config, plan: SpecPlan) -> WorkerOptions:
        return cls(plan=plan, dtype=cfg.draft_torch_dtype, device=cfg.draft_device or cfg.device,
                   cores=cfg.draft_cores, threads=cfg.threads, kv_cache_tokens=cfg.kv_cache_tokens,
                   block_size=cfg.block_size, timeout_s=cfg.worker_timeout_s, fast=cfg.fast,
                   draft_format=cfg.draft_format, max_num_seqs=cfg.max_num_seqs)

    @property
    def k(self) -> int:
        return self.plan.k

    def make_speculator(self, runner: ModelRunner, recorder: RankRecorder | None = None) -> Speculator:
        """The engine's speculator, or with ``recorder`` calibration's, which records bonus-token ranks.

        The draft's graphs are captured first (a GPU's paged backend; nothing elsewhere): every row bucket a
        tree step can reach, for every width of its extra slots (tree step j reads j + 1), so that no round
        captures, and the speculator never captures beside the target."""
        runner.capture_graphs(self.graph_rows(), tuple(range(self.k + 1)))
        if recorder is None:
            return Speculator(runner, self.k, self.plan)
        return RecordingSpeculator(runner, self.k, self.plan, recorder)

    def graph_rows(self) -> int:
        """The most rows one draft pass can have: every sequence of the largest batch, each with the widest tree
        the plan gives it (or a K+1-token catch-up)."""
        widest = max(sum(f) for table in self.plan.primary + self.plan.backup for f in table)
        return self.max_num_seqs * max(widest + 1, self.k + 1)

    def draft_blocks(self) -> int:
        """Room for every sequence's context plus the branch scratch of a full batch."""
        return math.ceil(self.kv_cache_tokens / self.block_size) * 2


def worker_main(port: int, counters: MessageCounters, draft: DraftSource, opts: WorkerOptions) -> None:
    """Entry point of the speculator process (started by ``WorkerLink`` through ``saguaro.ssd.launch``)."""
    if opts.device == "cpu":
        pin_process(opts.cores, opts.threads)
    else:
        torch.cuda.set_device(torch.device(opts.device))
    backend = "gloo" if opts.device == "cpu" else "nccl"
    channel = Channel(1, port, counters, backend, opts.device, opts.timeout_s)
    loaded = draft.load(opts.device, opts.dtype)
    runner = draft_runner(opts.draft_format, loaded, opts.draft_blocks(), opts.block_size, opts.device, opts.fast)
    speculator = opts.make_speculator(runner)
    vocab = loaded.config.vocab_size
    channel.send(torch.tensor([vocab], dtype=torch.int64))  # ready
    while True:
        try:
            req = unpack_request(channel.recv(alive=parent_alive))
        except ChannelClosed:  # the engine is gone: nobody to answer
            break
        if req.command == CMD_STOP:
            break
        if req.command == CMD_PREFILL:  # no response; a build it cut short stays as it is
            speculator.prefill(req)
            continue
        channel.send(pack_response(speculator.respond(req), opts.k))
        speculator.build(interrupted=channel.poll)
    speculator.close()


class WorkerLink:
    """The engine's handle on a running speculator process.

    ``draft`` is a registry name or path (the worker loads it) or a ``LoadedModel`` (its weights
    reach the worker in shared memory). Start-up raises ``WorkerStartError`` within
    ``opts.timeout_s`` of the worker dying or stalling (model loading gets at least 600 s).
    """

    def __init__(self, draft: Any, opts: WorkerOptions):
        self.opts = opts
        port = free_port()
        counters = MessageCounters()
        source = DraftSource.of(draft)
        try:
            self.process = WorkerProcess(worker_main, (port, counters, source, opts), [counters.file, source.file])
        finally:
            source.close()  # the worker inherited its own descriptor (or never started)
        backend = "gloo" if opts.device == "cpu" else "nccl"
        device = "cpu" if opts.device == "cpu" else opts.device
        try:
            self.channel = self.process.expect(
                "connecting", lambda: Channel(0, port, counters, backend, device, opts.timeout_s), opts.timeout_s)
            load_s = max(opts.timeout_s, 600)
            ready = self.process.expect(
                "loading the draft", lambda: self.channel.recv(timeout_s=load_s, alive=self.process.is_alive), load_s)
        except BaseException:
            self.process.kill()
            raise
        self.vocab = int(ready[0])

    def prefill(self, request: RoundRequest) -> None:
        """Send admissions to prefill ahead of their first round (no response). Raises ``ChannelClosed``."""
        self.channel.send(pack_request(request))

    def exchange(self, request: RoundRequest) -> RoundResponse:
        """Send one request, wait for the one response. Raises ``ChannelClosed`` on failure."""
        self.channel.send(pack_request(request))
        reply = self.channel.recv(timeout_s=self.opts.timeout_s, alive=self.process.is_alive)
        return unpack_response(reply, self.opts.k, self.vocab)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.channel.send(pack_request(RoundRequest(command=CMD_STOP)))
                self.process.join(timeout=5)
            except ChannelClosed:
                pass
        self.kill()

    def kill(self) -> None:
        self.process.kill()
        self.channel.close()

class InProcessLink:
    """A ``WorkerLink`` stand-in that runs the speculator in this process, synchronously."""

    def __init__(self, draft: Any, opts: WorkerOptions, recorder: RankRecorder | None = None):
        self.opts = opts
        runner = draft_runner(opts.draft_format, place(draft, opts.device, opts.dtype), opts.draft_blocks(),
                                          opts.block_size, opts.device, opts.fast)
        self.speculator: Speculator | None = opts.make_speculator(runner, recorder)

    def prefill(self, request: RoundRequest) -> None:
        if self.speculator is None:
            raise ChannelClosed("in-process speculator was stopped")
        self.speculator.prefill(request)

    def exchange(self, request: RoundRequest) -> RoundResponse:
        if self.speculator is None:
            raise ChannelClosed("in-process speculator was stopped")
        response = self.speculator.respond(request)
        self.speculator.build()
        return response

    def stop(self) -> None:
        if self.speculator is not None:
            self.speculator.close()
            self.speculator = None

    kill = stop
