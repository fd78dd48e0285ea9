"""The draft: one typed choice among none (AR), the n-gram matcher, a draft model and an EAGLE-3 head.

The builder (``saguaro.build.resolve_draft``) turns ``LLM``'s ``draft=`` and the ``Config`` into one of these,
once. Each kind answers what the engine asks of a draft, so that no code outside the builder asks which kind
it is:

  taps                      the target layers whose inputs it reads (an EAGLE-3 head's features; () otherwise)
  proposer(cfg, target, n)  its SD proposer, over ``n`` KV blocks of its own
  speculator_runner(opts)   its ``DraftRunner`` in the SSD speculator (a thread or a process)
  shipment()                what a speculator process receives of it (``received_draft`` rebuilds it there)

The EAGLE-3 kind is ``saguaro.eagle.draft.EagleDraft``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from saguaro.engine.draft_runner import DraftRunner
from saguaro.engine.model_runner import ModelRunner, draft_runner
from saguaro.loading import LoadedModel
from saguaro.loading.place import load_or_place
from saguaro.sd.types import Proposer
from saguaro.workers.shipment import Shipment, model_from, model_state

if TYPE_CHECKING:  # hints only
    from saguaro.config import Config
    from saguaro.ssd.host import SpeculatorOptions


class Draft(Protocol):
    taps: tuple[int, ...]

    def proposer(self, cfg: Config, target: ModelRunner, num_blocks: int) -> Proposer:
        ...


class SpeculatorDraft(Draft, Protocol):
    """A draft that can run in the SSD speculator: a model or an EAGLE-3 head."""

    def speculator_runner(self, opts: SpeculatorOptions) -> DraftRunner:
        ...

    def shipment(self) -> Shipment:
        ...


@dataclass
class NoDraft:
    """AR: the target decodes alone."""
    taps: tuple[int, ...] = ()

    def proposer(self, cfg: Config, target: ModelRunner, num_blocks: int) -> Proposer:
        raise ValueError("AR decodes without a proposer")


@dataclass
class NgramDraft:
    """SD's n-gram matcher: drafts from the sequence's own tokens, no model."""
    taps: tuple[int, ...] = ()

    def proposer(self, cfg: Config, target: ModelRunner, num_blocks: int) -> Proposer:
        from saguaro.sd.ngram_proposer import NgramProposer
        return NgramProposer()


@dataclass
class ModelDraft:
    """A draft model: ``model`` in memory (on the draft's device and dtype), and/or the registry ``name`` or path
    it came from, which a speculator process loads itself (mapping the same cached file) rather than
    receiving a copy."""
    model: LoadedModel | None = None
    name: str | None = None
    taps: tuple[int, ...] = ()

    def proposer(self, cfg: Config, target: ModelRunner, num_blocks: int) -> Proposer:
        from saguaro.sd.draft_model import DraftModelProposer
        runner = draft_runner(cfg.draft_format, self.model, num_blocks, cfg.block_size, cfg.draft_device or cfg.device,
                              cfg.enforce_eager, cfg.max_model_len)
        runner.capture_graphs(cfg.graph_rows)
        proposer = DraftModelProposer(runner)
        if proposer.steps_graph is not None:  # the paged backend: greedy rounds' steps 2..K, captured now too
            proposer.steps_graph.capture_all(cfg.max_num_seqs, cfg.num_speculative_tokens)
        return proposer

    def speculator_runner(self, opts: SpeculatorOptions) -> ModelRunner:
        loaded = load_or_place(self.model if self.model is not None else self.name, opts.device, opts.dtype)
        return draft_runner(opts.draft_format, loaded, opts.draft_blocks(), opts.block_size, opts.device,
                            opts.enforce_eager, opts.max_model_len)

    def shipment(self) -> Shipment:
        if self.name is not None:
            return Shipment.by_name(self.name)
        return Shipment.holding({"kind": ModelDraft, **model_state(self.model)})

    @classmethod
    def received(cls, saved: dict[str, Any], device: str, dtype: torch.dtype) -> "ModelDraft":
        return cls(model_from(saved, device, dtype))


def as_draft(draft: SpeculatorDraft | LoadedModel | str) -> SpeculatorDraft:
    """A bare model or name (calibration's and the tests' speculators) as the draft-model kind; a draft as it is."""
    if isinstance(draft, str):
        return ModelDraft(name=draft)
    return ModelDraft(draft) if isinstance(draft, LoadedModel) else draft


def received_draft(shipment: Shipment, device: str, dtype: torch.dtype) -> SpeculatorDraft:
    """In the speculator process: the draft its shipment carried, on ``device`` / ``dtype``."""
    if shipment.name is not None:
        return ModelDraft(load_or_place(shipment.name, device, dtype))
    saved = shipment.saved()
    return saved.pop("kind").received(saved, device, dtype)
