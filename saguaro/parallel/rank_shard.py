"""Which slice of each weight a rank holds: one rank's shard (``RankShard``) of a model over ``world`` ranks.

Glossary (H query heads, KVH key/value heads, I the MLP width, V the vocabulary, N ranks):
  column-parallel   q/k/v and gate/up: each rank holds some output rows (its heads, its I / N)
  row-parallel      o_proj and down: each rank holds the matching input columns; one all-reduce sums them
  vocab-parallel    embedding and LM head: each rank holds ceil(V / N) vocabulary rows, the last one padded
                    with zero rows, so every rank's logits have the same width for the gather
  replicated KV     when N > KVH each KV head lives on N / KVH ranks, the ones whose query heads read it

A size that does not divide raises ``ShardError`` naming the sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from saguaro.models.model_config import ModelConfig


class ShardError(ValueError):
    """The model's sizes cannot be split over this many ranks."""


@dataclass(frozen=True)
class Slice:
    """Rows or columns [start, stop) of a checkpoint tensor along ``dim``, zero-padded to ``size``."""
    dim: int
    start: int
    stop: int
    size: int


@dataclass(frozen=True)
class RankShard:
    rank: int
    world: int
    heads: int  # query heads per rank
    kv_heads: int  # key/value heads per rank (1 when replicated)
    kv_start: int  # this rank's first key/value head
    intermediate: int  # MLP width per rank
    vocab: int  # vocabulary rows per rank (padded)
    head_dim: int

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules and KV cache have (vocab_size is its padded vocabulary shard)."""
        return replace(cfg, num_heads=self.heads, num_kv_heads=self.kv_heads, intermediate_size=self.intermediate,
                       vocab_size=self.vocab, eos_token_ids=list(cfg.eos_token_ids))

    def slice_for(self, name: str, vocab_size: int) -> Slice | None:
        """The slice of checkpoint tensor ``name`` this rank holds; None for a replicated one (norms)."""
        d = self.head_dim
        rows = {"q_proj": (self.rank * self.heads * d, self.heads * d),
                "k_proj": (self.kv_start * d, self.kv_heads * d), "v_proj": (self.kv_start * d, self.kv_heads * d),
                "gate_proj": (self.rank * self.intermediate, self.intermediate),
                "up_proj": (self.rank * self.intermediate, self.intermediate)}
        cols = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        if module in rows:
            start, size = rows[module]
            return Slice(0, start, start + size, size)
        if module in cols and name.endswith(".weight"):
            start, size = cols[module]
            return Slice(1, start, start + size, size)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Slice(0, self.vocab_start, min(self.vocab_start + self.vocab, vocab_size), self.vocab)
        return None


def rank_shard(cfg: ModelConfig, world: int, rank: int) -> RankShard:
    """The shard of ``rank`` of ``world``, or ``ShardError`` naming the sizes that do not divide."""
    if world < 1 or not 0 <= rank < world:
        raise ShardError(f"rank {rank} of a tensor-parallel group of {world}")
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    problems = []
    if heads % world:
        problems.append(f"{heads} attention heads")
    if (kv % world if world <= kv else world % kv):
        problems.append(f"{kv} key/value heads (they split when N divides them, else are replicated when "
                        "they divide N)")
    if cfg.intermediate_size % world:
        problems.append(f"an MLP width of {cfg.intermediate_size}")
    if problems:
        raise ShardError(f"tensor_parallel_size={world} does not divide this model's sizes: "
                         f"{', '.join(problems)}; choose a size that divides them")
    if world <= kv:
        kv_heads, kv_start = kv // world, rank * (kv // world)
    else:  # each KV head on world / kv ranks: rank r's query heads all read head r // (world / kv)
        kv_heads, kv_start = 1, rank // (world // kv)
    return RankShard(rank, world, heads // world, kv_heads, kv_start, cfg.intermediate_size // world,
                     -(-cfg.vocab_size // world), cfg.head_dim)
