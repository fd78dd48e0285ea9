"""Runs one model on one device over its own paged KV cache.

Callers describe each sequence's slice of a forward pass as a ``ForwardItem`` (new tokens, where
they start, the sequence's block table, which logits they want; or an SSD tree step's rows). The
runner flattens the items into input ids, positions and the rows whose logits are wanted, and hands
the pass to its backend (``saguaro/backends``), which prepares the attention metadata its model
reads and runs it. Target and draft each own one runner.

Logits come back as float32 tensors on the model's device: sampling and verification run there
too, and the engine reads the new tokens back once per round.

``fast`` (the opposite of ``enforce_eager``) takes the fastest exact path the device supports: CUDA
graphs over fused kernels on a GPU, the bf16 C++ kernels on an AVX512-BF16 CPU; without it, and for
fp32 models on the CPU, the exact eager reference runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from saguaro.backends import ForwardItem, TreeRows, make_backend
from saguaro.device import to_device
from saguaro.engine.draft_runner import DraftRunner
from saguaro.kv.block_manager import BlockManager
from saguaro.kv.kv_cache import KVCache
from saguaro.models.transformer import CausalLM

if TYPE_CHECKING:  # hints only
    from saguaro.loading import LoadedModel
    from saguaro.models.draft_format import DraftFormat

__all__ = ["DraftRunner", "ForwardItem", "ModelRunner", "TreeRows"]


class ModelRunner(DraftRunner):
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: str = "cpu",
                 enforce_eager: bool = True, weights: str = "bf16", head_ids: torch.Tensor | None = None,
                 backend: str = "auto", graphs: bool = True, max_seq_len: int | None = None):
        device = torch.device(device)
        cache = KVCache(model.config, num_blocks, block_size, next(model.parameters()).dtype, device)
        longest = (max_seq_len or model.config.max_position_embeddings) + 64  # + a round's lookahead
        self._attach(model, device, cache, BlockManager(num_blocks, block_size),
                     make_backend(model, cache, device, enforce_eager, weights, head_ids, backend, graphs,
                                  max_table_blocks=min(num_blocks, -(-longest // block_size))))

    def _attach(self, model: CausalLM, device: torch.device, cache: KVCache, blocks: BlockManager, backend) -> None:
        """The runner's state, whoever built its cache and backend (a tensor-parallel rank builds its own)."""
        self.model, self.config, self.device = model, model.config, device
        self.cache, self.blocks, self.backend = cache, blocks, backend
        self._observer: Callable[[list[ForwardItem], torch.Tensor], None] | None = None
        self._captured_taps: tuple[int, ...] | None = None  # the taps in the backend's graphs, once captured

    def tap(self, layers: list[int], observer: Callable[[list[ForwardItem], torch.Tensor], None]) -> None:
        """After every pass, hand ``observer(items, features)`` the input hidden states of ``layers``
        (features [N, len(layers) * hidden], rows in item order): an EAGLE-3 draft's target features. Every
        backend: the CPU kernels split their one call of every layer at the taps, and the paged GPU path's
        graphs copy them out, so its graphs must be captured with these taps (``capture_graphs(taps=...)``)."""
        layers = tuple(layers)
        if self._captured_taps is not None and layers != self._captured_taps:
            raise ValueError(f"the target's graphs were captured tapping layers {list(self._captured_taps)}, not "
                             f"{list(layers)}: capture them with the taps the draft reads")
        self.net.taps = layers
        self._observer = observer

    @property
    def net(self):
        """The model the backend runs (eager ``CausalLM``, ``FastCausalLM`` or ``PagedCausalLM``)."""
        return self.backend.net

    @torch.inference_mode()
    def forward_flat(self, items: list[ForwardItem]) -> tuple[torch.Tensor | None, list[int]]:
        """The pass's wanted logits as one tensor [R, V] (items in order), with each wanting item's row count."""
        positions: list[int] = []
        rows: list[int] = []
        counts: list[int] = []
        for item in items:
            wanted = item.logit_rows()
            rows += [len(positions) + r for r in wanted]
            if item.logits != "none":
                counts.append(len(wanted))
            positions += item.positions
        meta = self.backend.prepare(items, self.block_size)
        logits = self.backend.run(self._input_ids(items), torch.tensor(positions, dtype=torch.long), meta,
                                  self.cache, torch.tensor(rows, dtype=torch.long))
        if self._observer is not None:
            self._observer(items, self.net.tapped)
        return logits, counts

    def _input_ids(self, items: list[ForwardItem]) -> torch.Tensor:
        """[N] token ids: a host tensor, or on the device when an item brings its ids there (a draft step
        feeding the tokens it just sampled, which the host has not read)."""
        if not any(isinstance(item.token_ids, torch.Tensor) for item in items):
            return torch.tensor([t for item in items for t in item.token_ids], dtype=torch.long)
        return torch.cat([to_device(item.token_ids if isinstance(item.token_ids, torch.Tensor)
                                    else torch.tensor(item.token_ids, dtype=torch.long), self.device)
                          for item in items])

    def capture_graphs(self, max_rows: int | None = None, extras: tuple[int, ...] = (0,),
                       taps: tuple[int, ...] = ()) -> None:
        """Capture the backend's graphs now, at start-up (``Backend.capture``), so no round ever captures.
        ``taps``: the layers whose inputs a later ``tap`` reads (an EAGLE-3 head's), captured into the graphs."""
        self.net.taps = tuple(taps)
        self.backend.capture(max_rows, extras)
        if getattr(self.backend, "graphs", None) is not None:
            self._captured_taps = tuple(taps)

    def close(self) -> None:
        self.backend.close()


def draft_runner(fmt: DraftFormat, draft: LoadedModel, num_blocks: int, block_size: int, device: str,
                 enforce_eager: bool, max_seq_len: int | None = None) -> ModelRunner:
    """The draft's runner: the fast path with ``fmt`` if custom (an error where it cannot run), else as
    the engine runs. ``max_seq_len``: the engine's ``max_model_len``, which bounds the block tables its
    graphs stage (the draft's own context length otherwise)."""
    return ModelRunner(draft.model, num_blocks, block_size, device, enforce_eager=enforce_eager and not fmt.custom,
                       weights=fmt.weights, head_ids=fmt.head_ids(draft), max_seq_len=max_seq_len)
