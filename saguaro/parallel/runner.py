"""Running a tensor-parallel target: rank 0's ``ModelRunner`` and the other ranks' pass loop.

Rank 0 is the engine: it owns the scheduler, the block manager, sampling and verification, exactly
as with one device. Its backend (``TPBackend``) sends each pass to the other ranks before running its
own shard of it; they run the same pass on theirs (``serve_passes``) and keep no state but their KV
cache. Every rank runs the eager reference on its shard.

Any failure inside a pass (a rank that died, a collective that timed out) leaves the ranks out of
step, so it is final: the backend raises ``TensorParallelError`` for that pass and every later one.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from saguaro.backends.base import Backend
from saguaro.backends.batch import ForwardItem
from saguaro.backends.dense import DenseBackend
from saguaro.engine.model_runner import ModelRunner
from saguaro.kv.block_manager import BlockManager
from saguaro.kv.kv_cache import KVCache
from saguaro.parallel.groups import TensorParallelError
from saguaro.parallel.layers import TPCausalLM
from saguaro.parallel.steps import Step, StepLink

log = logging.getLogger("saguaro.parallel")


class TPBackend(Backend):
    """Rank 0's backend: broadcast the step, then run this rank's shard of it (logits gathered here)."""
    name = "eager"

    def __init__(self, inner: DenseBackend, link: StepLink, describe: Callable[[], str]):
        super().__init__(inner.net, inner.device)
        self.inner, self.link, self.describe = inner, link, describe
        self.failure: str | None = None
        self.passes = 0  # passes run (``saguaro bench tp``: collective time per pass)

    def prepare(self, items: list[ForwardItem], block_size: int):
        return self.inner.prepare(items, block_size)

    def run(self, input_ids, positions, meta, cache, logit_rows):
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            self.link.send(Step(input_ids, positions, meta, logit_rows))
            self.passes += 1
            return self.inner.run(input_ids, positions, meta, cache, logit_rows)
        except Exception as e:  # noqa: BLE001 -- any failure mid-pass leaves the ranks out of step
            self.failure = (f"a tensor-parallel pass failed ({self.describe()}): {e}. The target cannot run "
                            "any more passes; close this LLM and start a new one")
            log.error("%s", self.failure)
            raise TensorParallelError(self.failure) from e

    def close(self) -> None:
        """Tell the other ranks to leave their loops (nothing to say to ranks that already failed)."""
        if self.failure is None:
            try:
                self.link.stop()
            except Exception as e:  # noqa: BLE001 -- closing: the launcher ends the processes anyway
                log.warning("could not tell the tensor-parallel ranks to stop: %s", e)
            self.failure = "the tensor-parallel target is closed"


def shard_cache(model: TPCausalLM, num_blocks: int, block_size: int, device: torch.device) -> KVCache:
    """This rank's KV cache: its own key/value heads only."""
    dtype = next(model.parameters()).dtype
    return KVCache(model.shard_config, num_blocks, block_size, dtype, device)


class TPModelRunner(ModelRunner):
    """Rank 0's runner: the engine's block manager and tables, this rank's shard of the cache and model."""

    def __init__(self, model: TPCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 link: StepLink, describe: Callable[[], str]):
        # an EAGLE-3 head taps rank 0's eager passes: the residual stream is all-reduced, whole on every rank
        device = torch.device(device)
        self._attach(model, device, shard_cache(model, num_blocks, block_size, device),
                     BlockManager(num_blocks, block_size),
                     TPBackend(DenseBackend(model, device, "eager"), link, describe))


@torch.inference_mode()
def serve_passes(model: TPCausalLM, link: StepLink, num_blocks: int, block_size: int,
                 device: torch.device) -> int:
    """A rank other than 0: run every pass rank 0 sends, on this rank's shard, until it says stop.
    Returns how many passes ran."""
    cache = shard_cache(model, num_blocks, block_size, device)
    backend = DenseBackend(model, device, "eager")
    passes = 0
    while (step := link.recv(device)) is not None:
        backend.run(step.input_ids, step.positions, step.meta, cache, step.logit_rows)
        passes += 1
    return passes
