"""The last response's speculations while they wait on the draft's device (the graph-build path).

A hit's tokens and ranked ids are gathered from the build's tables on the device, and a just-in-time draft's
stay where its steps drew them: the speculator answers without reading them. One ``Spoken`` holds them all, a
row per sequence answered that way. The next build stages its rows from here on the device
(``GraphBuild.run``); the next ``respond`` reads the tokens together with its outcome lookup, the round's one
read, to extend its copy of each sequence with the accepted ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Spoken:
    tokens: torch.Tensor  # [N, K] long; row r's first ``SpokenRow.tokens`` are its speculation, 0 past them
    rank_ids: torch.Tensor  # [N, K, W] long: the draft's ranked ids at each token's position
    rank_probs: torch.Tensor  # [N, K, W] float32

    @staticmethod
    def cat(parts: list[Spoken]) -> Spoken:
        if len(parts) == 1:
            return parts[0]
        return Spoken(torch.cat([p.tokens for p in parts]), torch.cat([p.rank_ids for p in parts]),
                      torch.cat([p.rank_probs for p in parts]))


@dataclass
class SpokenRow:
    """Where one sequence's speculation waits in ``Spoken``."""
    row: int
    tokens: int  # how many it holds
    ranked: int  # positions whose ranked ids it holds (the first ones)
