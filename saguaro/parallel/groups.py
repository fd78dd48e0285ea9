"""The tensor-parallel process groups of one target: who is where, and the collectives the model uses.

Glossary:
  rank      this process's place in the target's group (0 is the engine, the others serve its passes)
  world     how many processes (devices) share the target
  device group   NCCL on GPUs, Gloo on the CPU: the model's all-reduces and the logits gather
  control group  always Gloo: the step metadata rank 0 broadcasts each pass (never through NCCL)
  store     the rendezvous key/value store: a ``TCPStore`` that rank 0 hosts when Saguaro starts the
            ranks, torchrun's when torchrun does (``from_env``)

The groups are process-group objects of their own, not torch's global default group, so an SSD
speculator's channel (``ssd/channel.py``) and several engines in one process never meet them.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

IDLE = timedelta(days=7)  # the control group's own deadline: an engine may idle for long
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or could not start: the target cannot run any more passes."""


@dataclass
class CollectiveClock:
    """Seconds spent in collectives and how many ran (``saguaro bench tp`` reads them per step)."""
    seconds: float = 0.0
    count: int = 0

    def add(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.count += 1


@dataclass
class TPGroups:
    rank: int
    world: int
    store: dist.Store
    device_pg: dist.ProcessGroup
    control_pg: dist.ProcessGroup
    timeout_s: float
    clock: CollectiveClock = field(default_factory=CollectiveClock)

    # -- the model's collectives (device group) ---------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits)."""
        started = time.perf_counter()
        self.device_pg.allreduce([x]).wait()
        self.clock.add(started)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` [R, n] concatenated along the last dim on rank 0 ([R, world * n]); None elsewhere."""
        started = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.device_pg.gather([parts] if self.rank == 0 else [], [x], opts).wait()
        self.clock.add(started)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    # -- control group -------------------------------------------------------------------------
    def broadcast_control(self, x: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0's host tensor ``x`` on every rank (others pass a buffer of the same shape and dtype);
        ``timeout`` None waits without a deadline (a rank idling until the next step)."""
        started = time.perf_counter()
        if timeout is None:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            self.control_pg.broadcast([x], opts).wait()
        else:
            self.control_pg.broadcast(x, 0, timeout).wait()
        self.clock.add(started)
        return x

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (e.g. the KV blocks every rank can afford)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control_pg.allreduce([t], opts).wait()
        return int(t.item())


def connect(store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float) -> TPGroups:
    """Both groups over ``store`` (each under its own key prefix). A device collective fails after ``timeout_s``;
    control messages carry their own deadline (``StepLink``), as a rank waits for the next step without one."""
    timeout = timedelta(seconds=timeout_s)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world, IDLE)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        torch.cuda.set_device(device)
        dev_pg = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, world, opts)
    else:
        dev_pg = dist.ProcessGroupGloo(dist.PrefixStore("device/", store), rank, world, timeout)
    return TPGroups(rank, world, store, dev_pg, control, timeout_s)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets the env:// variables)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def env_store(timeout_s: float) -> dist.Store:
    """torchrun's rendezvous store (env://: MASTER_ADDR / MASTER_PORT, or the elastic agent's own store)."""
    rank, world, _ = torchrun_rank()
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout_s)))
    return dist.PrefixStore("saguaro-tp/", store)


def host_store(port: int, rank: int, world: int, timeout_s: float) -> dist.Store:
    """A ``TCPStore`` on this machine that rank 0 hosts (the ranks Saguaro starts itself)."""
    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=timeout_s))
