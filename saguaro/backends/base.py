"""The backend seam: how one model runs one forward pass on its device.

``ModelRunner`` (``engine/model_runner.py``) owns the cache and the block tables and describes each
pass as ``ForwardItem``s. A backend does the rest: ``prepare`` turns the items into the metadata its
model reads (host tensors), and ``run`` executes the model and returns float32 logits, on the
model's device, for the rows asked for. Three backends exist (``backends/__init__.py`` picks one):

=============  ====================================  =================================================
backend        model                                 metadata
=============  ====================================  =================================================
eager          ``CausalLM`` (the exact reference)     dense (``kv/metadata.py``): slots + boolean mask
cpu_kernels    ``FastCausalLM`` (bf16 C++ kernels)    dense
paged          ``PagedCausalLM`` (fused ops; CUDA     paged (``backends/paged/metadata.py``):
               graphs per bucket on a GPU)            block tables and per-row visibility
=============  ====================================  =================================================
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from saguaro.backends.batch import ForwardItem
from saguaro.kv.kv_cache import KVCache


class Backend(ABC):
    name: str = ""

    def __init__(self, net: Any, device: torch.device):
        self.net = net  # the model that runs passes: reads the metadata this backend prepares
        self.device = device

    @abstractmethod
    def prepare(self, items: list[ForwardItem], block_size: int) -> Any:
        """The pass's attention metadata, as host tensors."""

    @abstractmethod
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, cache: KVCache,
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        """Run the pass; float32 logits [len(logit_rows), V] on ``device`` (None when no row is asked for).

        ``input_ids`` [N] may already be on the device (a draft step feeding the tokens it just sampled);
        ``positions`` [N] and ``logit_rows`` [R] (indices into the N rows) are host tensors."""

    def capture(self, max_rows: int | None = None, extras: tuple[int, ...] = (0,)) -> None:
        """Start-up, before any round: capture what the backend replays (CUDA graphs of every row bucket up to
        ``max_rows``, for each width of per-row extra slots in ``extras``). Nothing for backends without graphs."""

    def close(self) -> None:
        """Release what the backend holds beyond the model (captured graphs)."""
