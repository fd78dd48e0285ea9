"""Tensor-parallel ranks as threads of the test process (not a test file).

Each thread connects its own Gloo groups over one ``TCPStore``, so sharded layers and models run
their real collectives with no process to start.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from saguaro.models.model_config import ModelConfig
from saguaro.parallel.groups import TPGroups, connect, host_store
from saguaro.parallel.rank_shard import rank_shard
from saguaro.workers.process import free_port


def run_ranks(world: int, fn: Callable[[TPGroups], Any], timeout_s: float = 60.0) -> list[Any]:
    """``fn(groups)`` on every rank at once; the results in rank order (a rank's exception is raised here)."""
    port = free_port()
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store = host_store(port, r, world, timeout_s)
            results[r] = fn(connect(store, r, world, torch.device("cpu"), timeout_s))
        except BaseException as e:  # noqa: BLE001 -- raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return results


def assert_shards_join(whole: dict[str, torch.Tensor], parts: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> None:
    """Every rank's slices, put together in rank order (padding dropped), equal the original tensors;
    replicated ones are equal on every rank."""
    shard = rank_shard(cfg, len(parts), 0)
    for name, tensor in whole.items():
        s = shard.slice_for(name, cfg.vocab_size)
        if s is None:
            assert all(torch.equal(p[name], tensor) for p in parts), name
            continue
        joined = torch.cat([p[name] for p in parts], dim=s.dim).narrow(s.dim, 0, tensor.shape[s.dim])
        assert torch.equal(joined, tensor), name
