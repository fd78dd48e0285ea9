"""An EAGLE-3 head as the engine's draft: the draft kind that reads the target's features.

It answers what the engine asks of any draft kind (``saguaro.drafts``): the target layers it taps, its SD
proposer, its runner in the SSD speculator and what a speculator process receives of it. What it holds of
the target is what a speculator in another process can hold too: the target's config (the layer count and
width that fix its taps and ``fc``) and its token embeddings, whole (a head without an embedding table of
its own shares them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from saguaro.eagle.checkpoint import load_eagle3_config
from saguaro.eagle.head import Eagle3Head, head_for
from saguaro.eagle.runner import EagleRunner
from saguaro.models.model_config import ModelConfig
from saguaro.workers.shipment import Shipment

if TYPE_CHECKING:  # hints only
    from saguaro.config import Config
    from saguaro.eagle.proposer import EagleProposer
    from saguaro.engine.model_runner import ModelRunner
    from saguaro.ssd.host import SpeculatorOptions


@dataclass
class EagleDraft:
    head_dir: str
    target_config: ModelConfig
    embed: torch.Tensor  # [V, H_t] the target's token embeddings (whole, also under tensor parallelism)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose inputs the head reads."""
        return tuple(load_eagle3_config(self.head_dir).taps_for(self.target_config.num_layers))

    def head(self, device: torch.device | str, dtype: torch.dtype) -> Eagle3Head:
        """The head on ``device``; one without an embedding table reads the target's (shared where it is)."""
        embed = nn.Embedding.from_pretrained(self.embed.to(device), freeze=True)
        return head_for(self.head_dir, self.target_config, embed, dtype).to(device)

    def proposer(self, cfg: Config, target: ModelRunner, num_blocks: int) -> EagleProposer:
        """SD: the head drafts from ``target``'s features (its runner taps them), in the target's dtype."""
        from saguaro.eagle.proposer import EagleProposer
        return EagleProposer(self.head(target.device, self.embed.dtype), target, num_blocks, cfg.block_size)

    def runner(self, num_blocks: int, block_size: int, device: str, dtype: torch.dtype) -> EagleRunner:
        return EagleRunner(self.head(device, dtype), num_blocks, block_size, device)

    def speculator_runner(self, opts: SpeculatorOptions) -> EagleRunner:
        """SSD: the head as the speculator's draft runner, fed the target's features through the messages."""
        return self.runner(opts.draft_blocks(), opts.block_size, opts.device, opts.dtype)

    def shipment(self) -> Shipment:
        """What a speculator process receives: the head's directory, the target's config and embeddings."""
        return Shipment.holding({"kind": EagleDraft, "head_dir": self.head_dir, "config": self.target_config,
                                 "embed": self.embed})

    @classmethod
    def received(cls, saved: dict[str, Any], device: str, dtype: torch.dtype) -> "EagleDraft":
        return cls(saved["head_dir"], saved["config"], saved["embed"])
