"""The tiled causal attention of the CPU kernels (prefill chunks: 16 or more queries, each seeing a prefix of its
context) against the fp32 eager reference, on every kernel tier this CPU executes: chunks at the start of a prompt
and late in it, lengths that end on, before and after a key block (64) or a query block (16), odd lengths, grouped
and plain heads, and a batch that mixes a tiled group with decode, verification and tree groups (the tier's other
kernel) in one call."""
import pytest
import torch

from saguaro.backends.cpu_kernels import build as kernels
from saguaro.kv.metadata import build_metadata
from saguaro.models.transformer import paged_attention


@pytest.fixture(scope="module")
def ops(cpu_tier):
    return kernels.load(cpu_tier)


def _run(ops, groups, heads, kv_heads, head_dim, seed=0):
    """groups: (context slots, mask [q, len]) per group; compares kernel and reference."""
    torch.manual_seed(seed)
    slots = 1 + max(max(c) for c, _ in groups)
    k_cache, v_cache = (torch.randn(2, slots, kv_heads, head_dim) * 2).bfloat16()
    meta = build_metadata([c for c, _ in groups], [m.shape[0] for _, m in groups], [m for _, m in groups])
    n = sum(m.shape[0] for _, m in groups)
    q = torch.randn(n, heads, head_dim).bfloat16()
    qkv = torch.cat((q.view(n, -1), torch.zeros(n, 2 * kv_heads * head_dim, dtype=torch.bfloat16)), 1)
    ref = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, head_dim ** -0.5)
    got = ops.attention(qkv, k_cache, v_cache, meta.query_index, meta.query_valid, meta.context_slots, meta.mask,
                        heads, kv_heads, head_dim, head_dim ** -0.5)
    torch.testing.assert_close(got.float().view(n, heads, head_dim), ref, rtol=0.02, atol=0.02)


def _chunk(cached: int, new: int, first_slot: int = 0) -> tuple[list[int], torch.Tensor]:
    """A prefill chunk of ``new`` tokens after ``cached`` ones: causal over scattered slots."""
    slots = [first_slot + 3 * i + (i % 5) for i in range(cached + new)]  # not contiguous, as blocks are not
    return slots, torch.ones(new, cached + new, dtype=torch.bool).tril(cached)


@pytest.mark.parametrize("cached, new", [(0, 16), (0, 17), (0, 63), (0, 64), (0, 65), (1, 31), (48, 16),
                                         (100, 33), (191, 66), (5, 129)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 128)])
def test_causal_chunks_match_the_reference(ops, cached, new, heads, kv_heads, head_dim):
    _run(ops, [_chunk(cached, new)], heads, kv_heads, head_dim, seed=cached + new)


def test_mixed_batch(ops):
    """A tiled chunk beside a decode token, a K+1 verification, a short chunk (15 queries: the other kernel) and
    tree branches, in one call."""
    tree = torch.zeros(5, 65, dtype=torch.bool)
    tree[:, :60] = True
    tree[torch.arange(5), 60 + torch.arange(5)] = True
    groups = [_chunk(70, 40, 0), (list(range(1000, 1077)), torch.ones(1, 77, dtype=torch.bool)),
              _chunk(30, 5, 2000), _chunk(0, 15, 3000), (list(range(4000, 4065)), tree), _chunk(130, 20, 5000)]
    _run(ops, groups, 9, 3, 64, seed=7)
