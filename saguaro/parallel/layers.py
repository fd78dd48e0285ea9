"""Sharded layers and the tensor-parallel model: one rank's slice of a ``CausalLM``.

The model is the eager ``CausalLM`` built at this rank's shapes (``RankShard.local_config``): its
q/k/v and gate/up projections are then column-parallel as they stand (they hold this rank's output
rows), attention runs on this rank's heads against its own KV cache, and the norms are replicated.
Three modules change, keeping their parameter names so shard state dicts load as they are:

  RowParallelLinear        o_proj and down: this rank's input columns, then one all-reduce
  VocabParallelEmbedding   this rank's vocabulary rows; ids outside them read zeros; one all-reduce
  TPCausalLM.logits        this rank's vocabulary columns, gathered to rank 0 only (None elsewhere)

Shapes: x [N, hidden] is the same on every rank between layers; logits [R, V] exist on rank 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from saguaro.models.model_config import ModelConfig
from saguaro.models.transformer import CausalLM
from saguaro.parallel.groups import TPGroups
from saguaro.parallel.rank_shard import RankShard


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T): each rank multiplies its slice of the input features."""

    def __init__(self, in_shard: int, out_features: int, groups: TPGroups):
        super().__init__(in_shard, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + shard) of the embedding; each id is looked up on the one rank that holds it."""

    def __init__(self, shard: int, dim: int, start: int, groups: TPGroups):
        super().__init__(shard, dim)
        self.start = start
        self.groups = groups

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.groups.all_reduce(x)


class TPCausalLM(CausalLM):
    """One rank's shard of a ``CausalLM``. ``config`` is the whole model's (what the engine reads);
    ``shard_config`` the shapes here (what the KV cache is sized by)."""

    def __init__(self, cfg: ModelConfig, shard: RankShard, groups: TPGroups):
        local = shard.local_config(cfg)
        super().__init__(local)
        self.config, self.shard_config, self.shard, self.groups = cfg, local, shard, groups
        backbone = self.model
        backbone.embed_tokens = VocabParallelEmbedding(shard.vocab, cfg.hidden_size, shard.vocab_start, groups)
        for layer in backbone.layers:
            layer.self_attn.o_proj = RowParallelLinear(shard.heads * cfg.head_dim, cfg.hidden_size, groups)
            layer.mlp.down_proj = RowParallelLinear(shard.intermediate, cfg.hidden_size, groups)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [R, V] on rank 0 (every rank must call it with the same rows); None on the others."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        full = self.groups.gather_last_dim(F.linear(hidden, weight).float())
        return None if full is None else full[:, :self.config.vocab_size]
