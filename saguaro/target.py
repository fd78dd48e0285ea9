"""The target: its model, its runner and how long a sequence may grow, on one device or sharded.

``build_target`` is the one place that tells one device from a tensor-parallel group: with
``tensor_parallel_size`` > 1 the target is rank 0's shard and runner (``saguaro.parallel``; under torchrun a
rank other than 0 serves rank 0's passes in there and then exits); otherwise the whole model, loaded or
placed on ``Config.device``, and its own runner. Whoever holds a ``Target`` asks it, and not its model, for
what a draft reads of it (``embeddings``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from saguaro.config import Config
from saguaro.engine.model_runner import ModelRunner
from saguaro.loading import LoadedModel
from saguaro.loading.place import load_or_place

if TYPE_CHECKING:  # hints only
    from saguaro.parallel.launch import TensorParallelTarget
    from saguaro.workers.process import WorkerProcess


@dataclass
class Target:
    loaded: LoadedModel  # rank 0's shard under tensor parallelism
    runner: ModelRunner  # its graphs are captured once the draft is known (``saguaro.build.build_decoder``)
    max_model_len: int
    group: TensorParallelTarget | None = None  # the ranks, under tensor parallelism

    @property
    def workers(self) -> list[WorkerProcess]:
        """The rank processes this engine started (none on one device, or under torchrun)."""
        return self.group.workers if self.group is not None else []

    def embeddings(self) -> torch.Tensor:
        """The whole token embedding table [V, H] (what an EAGLE-3 head without its own reads)."""
        if self.group is not None:
            return self.group.embeddings()
        return self.loaded.model.model.embed_tokens.weight

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def build_target(source: str | LoadedModel, cfg: Config) -> Target:
    """The target of ``cfg`` from ``source`` (a registry name or path, or a ``LoadedModel``)."""
    num_blocks = math.ceil(cfg.kv_cache_tokens / cfg.block_size)
    if cfg.tensor_parallel_size > 1:
        from saguaro.parallel.launch import RankOptions, TensorParallelTarget
        group = TensorParallelTarget(source, RankOptions.from_config(cfg, num_blocks))
        return Target(group.loaded, group.runner, _max_model_len(cfg, group.loaded), group)
    loaded = load_or_place(source, cfg.device, cfg.target_torch_dtype)
    max_len = _max_model_len(cfg, loaded)
    runner = ModelRunner(loaded.model, num_blocks, cfg.block_size, cfg.device, enforce_eager=cfg.enforce_eager,
                         weights=cfg.target_weights, max_seq_len=max_len)
    return Target(loaded, runner, max_len)


def _max_model_len(cfg: Config, loaded: LoadedModel) -> int:
    """``cfg.max_model_len``, at most the model's context length (the default)."""
    limit = loaded.config.max_position_embeddings
    return min(cfg.max_model_len or limit, limit)
