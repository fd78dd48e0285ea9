"""Starting a tensor-parallel target: Saguaro starts the ranks itself, or torchrun started them.

* ``LLM(..., tensor_parallel_size=N)`` in a plain process: rank 0 is this process; ranks 1..N-1 are fresh
  interpreters (``saguaro.workers``' ``WorkerProcess``: they never re-import ``__main__``, the model reaches
  them by name or in shared memory, every start-up wait watches them). Rank 0 hosts the store.
* Under ``torchrun --nproc-per-node N`` (one or several machines: ``--nnodes --node-rank --master-addr``)
  every process runs the user's script; in ``LLM(...)`` rank 0 goes on as the engine and every other rank
  serves rank 0's passes and then exits the process when rank 0 closes.

Both paths then run the same code: connect the groups, load this rank's shard, agree on the KV block
count (the smallest any rank can hold), and run.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from saguaro.config import Config
from saguaro.cores import pin_process
from saguaro.loading import LoadedModel
from saguaro.parallel.groups import (TensorParallelError, connect, env_store, host_store, torchrun_rank,
                                     under_torchrun)
from saguaro.parallel.rank_shard import rank_shard
from saguaro.parallel.runner import TPModelRunner, serve_passes
from saguaro.parallel.shards import load_shard, read_whole
from saguaro.parallel.steps import StepLink
from saguaro.workers.process import WorkerProcess, expect_all, free_port, parent_alive
from saguaro.workers.shipment import Shipment, model_state

log = logging.getLogger("saguaro.parallel")
START_TIMEOUT_S = 900.0  # loading a shard of a large checkpoint the first time (a GGUF conversion) is slow
_RANK_HINT = ("if nothing killed it on purpose, the machine is probably out of memory; otherwise fix the "
              "error above, or run with tensor_parallel_size=1")


@dataclass
class RankOptions:
    """What every rank needs from the engine's ``Config``."""
    world: int
    dtype: torch.dtype
    device: str  # rank 0's device; rank r uses the r-th device after it ("cuda:k" -> "cuda:k+r")
    num_blocks: int
    block_size: int
    timeout_s: float
    threads: int
    cores: list[int] | None

    @classmethod
    def from_config(cls, cfg: Config, num_blocks: int) -> "RankOptions":
        return cls(cfg.tensor_parallel_size, cfg.torch_dtype, cfg.device, num_blocks, cfg.block_size,
                   cfg.worker_timeout_s, cfg.threads, cfg.target_cores)

    def device_for(self, local_rank: int) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        base = torch.device(self.device).index or 0
        return torch.device("cuda", base + local_rank)

    def cores_for(self, rank: int) -> list[int] | None:
        """Rank r's CPU core: the r-th listed, or the r-th after the first listed (one core per rank)."""
        if self.cores is None:
            return None
        if len(self.cores) >= self.world:
            return [self.cores[rank]]
        return [(self.cores[0] + rank) % (os.cpu_count() or 1)]


class TensorParallelTarget:
    """Rank 0's handle on its group: its shard of the target, its runner, and the ranks it started."""

    def __init__(self, source: Any, opts: RankOptions):
        self.source, self.opts = source, opts
        self.workers: list[WorkerProcess] = []
        self.runner: TPModelRunner | None = None
        try:
            self._start(source, opts)
        except BaseException:
            self.close()  # a size that does not divide, a rank that died: no rank is left waiting
            raise

    def _start(self, source: Any, opts: RankOptions) -> None:
        if isinstance(source, LoadedModel):  # sizes that do not divide are refused before any rank starts
            rank_shard(source.config, opts.world, 0)
        shared: Shipment | None = None
        if under_torchrun():
            rank, world, local = torchrun_rank()
            if world != opts.world:
                raise ValueError(f"torchrun started {world} processes but tensor_parallel_size={opts.world}")
            pin_process(opts.cores_for(local), opts.threads)
            if rank != 0:  # this process only serves rank 0's passes: it ends here
                run_rank(env_store(START_TIMEOUT_S), rank, local, opts, source)
                sys.exit(0)
            store = env_store(START_TIMEOUT_S)
        else:
            pin_process(opts.cores_for(0), opts.threads)
            shared = Shipment.by_name(source) if isinstance(source, str) else Shipment.holding(model_state(source))
            port = free_port()
            self.workers = [WorkerProcess(spawned_rank, (port, r, opts, shared), [shared.file],
                                          role=f"tensor-parallel rank {r}", hint=_RANK_HINT)
                            for r in range(1, opts.world)]
            store = self._watch("connecting", lambda: host_store(port, 0, opts.world, START_TIMEOUT_S))
        device = opts.device_for(0)
        groups = self._watch("connecting", lambda: connect(store, 0, opts.world, device, opts.timeout_s))
        self.loaded = load_shard(source, groups, opts.dtype, device)
        num_blocks = self._watch("loading its shard", lambda: groups.agree_min(opts.num_blocks))
        if shared is not None:
            shared.close()  # every rank has its shard: the shared copy of an in-memory model can go
        self.runner = TPModelRunner(self.loaded.model, num_blocks, opts.block_size, device, StepLink(groups),
                                    self.describe)

    def embeddings(self) -> torch.Tensor:
        """The whole token embedding table [V, H] (rank 0 holds a vocabulary shard of it): from the model in
        memory, or read from the checkpoint."""
        if isinstance(self.source, LoadedModel):
            return self.source.model.model.embed_tokens.weight.to(self.opts.dtype)
        return read_whole(self.source, "model.embed_tokens.weight", self.opts.dtype)

    def _watch(self, stage: str, wait):
        if not self.workers:  # torchrun watches its own processes
            return wait()
        return expect_all(self.workers, stage, wait, START_TIMEOUT_S)

    def describe(self) -> str:
        """How the other ranks are doing, for an error message."""
        if not self.workers:
            return "ranks started by torchrun: see their logs"
        return "; ".join(f"{w.role}: {w.how_it_ended()}" if not w.is_alive() else f"{w.role}: running"
                         for w in self.workers)

    def close(self) -> None:
        """Stop the other ranks (they leave their loop), and end any that does not within a few seconds."""
        told = self.runner is not None  # a failed start told them nothing: they go at once
        if told:
            self.runner.backend.close()
        for w in self.workers:
            if told:
                w.join(5.0)
            w.kill()
        self.workers = []


def run_rank(store, rank: int, local_rank: int, opts: RankOptions, source: Any) -> None:
    """A rank other than 0, under torchrun or started by Saguaro: connect, load, agree, serve until stop."""
    device = opts.device_for(local_rank)
    groups = connect(store, rank, opts.world, device, opts.timeout_s)
    loaded = load_shard(source, groups, opts.dtype, device, progress=False)
    num_blocks = groups.agree_min(opts.num_blocks)
    try:
        passes = serve_passes(loaded.model, StepLink(groups), num_blocks, opts.block_size, device)
    except RuntimeError as e:  # rank 0 died or a collective failed: nothing more to serve
        raise TensorParallelError(f"tensor-parallel rank {rank} stops: {e}") from e
    log.debug("tensor-parallel rank %d served %d passes", rank, passes)


def spawned_rank(port: int, rank: int, opts: RankOptions, source: Shipment) -> None:
    """The entry point of a rank Saguaro started (``WorkerProcess``)."""
    pin_process(opts.cores_for(rank), opts.threads)
    try:
        run_rank(host_store(port, rank, opts.world, START_TIMEOUT_S), rank, rank, opts, source)
    except TensorParallelError as e:
        if parent_alive():
            raise
        log.debug("%s (the engine is gone)", e)
