"""Each sharded layer, and the sharded model, equals its unsharded reference in fp32 (2 ranks, Gloo)."""
import pytest
import torch
import torch.nn.functional as F

from saguaro.config import Config
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.models.model_config import ModelConfig
from saguaro.parallel import ShardError, rank_shard
from saguaro.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from saguaro.parallel.shards import build_shard, shard_state
from tests.tiny import tiny_model
from tests.tp_ranks import assert_shards_join, run_ranks


def _tiny(vocab: int = 64, kv_heads: int = 2, tie: bool = False):
    loaded = tiny_model(seed=5, vocab=vocab)
    cfg = ModelConfig(**{**loaded.config.to_dict(), "num_kv_heads": kv_heads, "tie_word_embeddings": tie})
    from saguaro.loading.model_builder import build_model
    state = {k: v[: kv_heads * cfg.head_dim] if k.split(".")[-2] in ("k_proj", "v_proj") else v
             for k, v in loaded.model.state_dict().items() if not (tie and k == "lm_head.weight")}
    return cfg, build_model(cfg, state)


def test_row_parallel_linear_and_vocab_parallel_embedding():
    torch.manual_seed(0)
    w, x = torch.randn(16, 24), torch.randn(5, 24)
    table, ids = torch.randn(11, 8), torch.tensor([0, 5, 6, 10, 3])  # 11 rows over 2 ranks: 6 + 5 (padded)

    def rank(g):
        row = RowParallelLinear(12, 16, g)
        row.weight.data = w[:, 12 * g.rank:12 * (g.rank + 1)].clone()
        emb = VocabParallelEmbedding(6, 8, 6 * g.rank, g)
        emb.weight.data = torch.cat([table, torch.zeros(1, 8)])[6 * g.rank:6 * (g.rank + 1)].clone()
        return row(x[:, 12 * g.rank:12 * (g.rank + 1)]), emb(ids)
    for y, e in run_ranks(2, rank):
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-6, atol=1e-5)
        assert torch.equal(e, table[ids])  # one rank holds each row: the sum adds zeros only


@pytest.mark.parametrize("vocab,kv_heads,tie,world", [
    (64, 2, False, 2),  # GQA: one KV head per rank
    (64, 1, False, 2),  # a KV head replicated on both ranks
    (63, 2, True, 2),  # a vocabulary that does not divide, tied head
    (64, 1, False, 4),  # 4 ranks, each query head pair reading the one KV head
])
def test_sharded_model_equals_reference(vocab, kv_heads, tie, world):
    cfg, ref = _tiny(vocab, kv_heads, tie)
    ids, positions = torch.tensor([3, 9, 1, vocab - 1, 7]), torch.arange(5)
    meta = build_metadata([list(range(5))], [5])
    want = ref.logits(ref(ids, positions, KVCache(cfg, 8, 1, torch.float32), meta))

    def rank(g):
        model = build_shard(cfg, ref.state_dict(), g, torch.float32, "cpu")
        hidden = model(ids, positions, KVCache(model.shard_config, 8, 1, torch.float32), meta)
        return model.logits(hidden)
    got = run_ranks(world, rank)
    assert all(g is None for g in got[1:])  # logits exist on rank 0 only
    assert got[0].shape == (5, vocab)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_shards_put_together_equal_the_tiny_model():
    cfg, ref = _tiny(vocab=63)
    state = ref.state_dict()
    assert_shards_join(state, [shard_state(state, rank_shard(cfg, 2, r), cfg.vocab_size) for r in range(2)], cfg)


def test_sizes_that_do_not_divide_are_refused_by_name():
    smollm = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    with pytest.raises(ShardError, match="9 attention heads.*3 key/value heads"):
        rank_shard(smollm, 2, 0)
    qwen15 = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                         num_heads=12, num_kv_heads=2, head_dim=128)  # Qwen2.5-1.5B: KV heads replicated at 4
    shards = [rank_shard(qwen15, 4, r) for r in range(4)]
    assert [p.kv_start for p in shards] == [0, 0, 1, 1] and {p.heads for p in shards} == {3}
    with pytest.raises(ShardError, match="12 attention heads"):
        rank_shard(qwen15, 8, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Config(target="x", tensor_parallel_size=0)


def test_tensor_parallel_flag_reaches_generate_and_serve():
    from saguaro.cli import _engine_options, build_parser
    for command in (["generate", "--model", "m", "--prompt", "x"], ["serve", "--model", "m"]):
        args = build_parser().parse_args(command + ["--tensor-parallel-size", "2"])
        assert _engine_options(args)["tensor_parallel_size"] == 2
