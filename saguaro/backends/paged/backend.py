"""The paged backend: ``PagedCausalLM`` over ``PagedMetadata``, replayed from CUDA graphs where it fits.

A pass whose row count has a bucket replays that bucket's graph (``backends/paged/graphs.py``); a larger
one (a long prefill), or one whose graph was not captured at start-up, runs the same model eagerly. With
``graphs=None`` every pass runs eagerly.
"""
from __future__ import annotations

import torch

from saguaro.backends.base import Backend
from saguaro.backends.batch import ForwardItem
from saguaro.backends.paged.graphs import GraphRunner
from saguaro.backends.paged.model import PagedCausalLM
from saguaro.device import to_device
from saguaro.kv.kv_cache import KVCache
from saguaro.backends.paged.metadata import PagedMetadata, paged_metadata


class PagedBackend(Backend):
    name = "paged"

    def __init__(self, net: PagedCausalLM, device: torch.device, graphs: GraphRunner | None):
        super().__init__(net, device)
        self.graphs = graphs
        self.replays = 0  # passes served by a graph (tests and benchmarks read these)
        self.eager_passes = 0

    def prepare(self, items: list[ForwardItem], block_size: int) -> PagedMetadata:
        return paged_metadata(items, block_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata, cache: KVCache,
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        dev = self.device
        if self.graphs is not None and self.graphs.fits(meta):
            logits = self.graphs.replay(input_ids, positions, meta)
            if logits is not None:
                self.replays += 1
                # a gather copies the rows out of the graph's output, which the next replay overwrites
                return logits[to_device(logit_rows, dev)] if logit_rows.numel() else None
        self.eager_passes += 1
        hidden = self.net(to_device(input_ids, dev), to_device(positions, dev), cache, _to(meta, dev))
        return self.net.logits(hidden[to_device(logit_rows, dev)]) if logit_rows.numel() else None

    def capture(self, max_rows: int | None = None, extras: tuple[int, ...] = (0,)) -> None:
        if self.graphs is not None:
            self.graphs.capture_all(max_rows, extras)

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()


def _to(meta: PagedMetadata, device: torch.device) -> PagedMetadata:
    moved = {name: to_device(t, device) for name, t in meta.tensors().items()}
    return PagedMetadata(**moved, block_size=meta.block_size)
