"""The CPU kernels' attention (one kernel per tier for decode, verification, tree branches and prefill chunks) on
every kernel tier this CPU executes:
  * against the fp32 eager reference: chunks at the start of a prompt and late in it, lengths that end on, before and
    after a key block (64), odd lengths, grouped and plain heads, and a batch that mixes a chunk with decode,
    verification and tree groups in one call;
  * a query's bits depend only on its own mask and keys, not on the pass it is in: a prompt position attended in a
    long chunk, in short ones, alone, or beside tree branches gives the same bits, and so a prompt's logprobs and
    its greedy continuation do not depend on where its prefill chunks fall."""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.backends.cpu_kernels import build as kernels
from saguaro.kv.metadata import build_metadata
from saguaro.models.transformer import paged_attention
from tests.tiny import tiny_model


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
    """A chunk beside a decode token, a K+1 verification, a short chunk and tree branches, in one call."""
    tree = torch.zeros(5, 65, dtype=torch.bool)
    tree[:, :60] = True
    tree[torch.arange(5), 60 + torch.arange(5)] = True
    groups = [_chunk(70, 40, 0), (list(range(1000, 1077)), torch.ones(1, 77, dtype=torch.bool)),
              _chunk(30, 5, 2000), _chunk(0, 15, 3000), (list(range(4000, 4065)), tree), _chunk(130, 20, 5000)]
    _run(ops, groups, 9, 3, 64, seed=7)


def _attend(ops, groups, q, k_cache, v_cache, heads, kv_heads, head_dim):
    """ops.attention of one query row per mask row (q [rows, heads, head_dim], in group order)."""
    meta = build_metadata([c for c, _ in groups], [m.shape[0] for _, m in groups], [m for _, m in groups])
    n = q.shape[0]
    qkv = torch.cat((q.view(n, -1), torch.zeros(n, 2 * kv_heads * head_dim, dtype=torch.bfloat16)), 1)
    return ops.attention(qkv, k_cache, v_cache, meta.query_index, meta.query_valid, meta.context_slots, meta.mask,
                         heads, kv_heads, head_dim, head_dim ** -0.5)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (14, 2, 64)])
def test_a_querys_bits_do_not_depend_on_its_pass(ops, heads, kv_heads, head_dim):
    """Positions 100..229 of a 230-token context, attended as one chunk, as chunks of 1..40 queries, one at a time
    (decode) and as the first rows of groups whose other rows are tree branches (the mask read from its bytes):
    every query's output bits are the same in all of them. Key blocks of 64 are crossed, and the chunks start
    inside them."""
    torch.manual_seed(11)
    cached, new = 100, 130
    slots, mask = _chunk(cached, new)
    k_cache, v_cache = (torch.randn(2, 1 + max(slots), kv_heads, head_dim) * 2).bfloat16()
    q = torch.randn(new, heads, head_dim).bfloat16()

    def cut(sizes):
        groups, start = [], 0
        for size in sizes:
            end = min(new, start + size)
            groups.append((slots[:cached + end], mask[start:end, :cached + end]))
            start = end
        return _attend(ops, groups, q, k_cache, v_cache, heads, kv_heads, head_dim)

    whole = cut([new])
    runs = {"16s": [16] * 9, "15s": [15] * 9, "mixed": [1, 5, 40, 16, 3, 65], "decode": [1] * new}
    for name, sizes in runs.items():
        assert torch.equal(cut(sizes), whole), name
    # beside tree branches: query i alone in a group with 3 branch rows that see the prefix and one node each
    rows = []
    for i in range(0, new, 13):
        seen = cached + i + 1
        tree = torch.zeros(4, seen + 3, dtype=torch.bool)
        tree[:, :seen] = True
        tree[0, seen:] = False
        tree[torch.arange(1, 4), seen + torch.arange(3)] = True
        tree[1:, seen - 1] = False  # the branches skip the query's own last key: their masks are not prefixes
        extra = [10_000 + j for j in range(3)]
        k_more, v_more = (torch.randn(2, 10_003 - k_cache.shape[0], kv_heads, head_dim)).bfloat16()
        kc, vc = torch.cat((k_cache, k_more)), torch.cat((v_cache, v_more))
        qs = torch.cat((q[i:i + 1], torch.randn(3, heads, head_dim).bfloat16()))
        out = _attend(ops, [(slots[:seen] + extra, tree)], qs, kc, vc, heads, kv_heads, head_dim)
        rows.append(torch.equal(out[0], whole[i]))
    assert all(rows), rows


def test_a_prompts_logprobs_do_not_depend_on_its_chunks(cpu_tier, monkeypatch):
    """A 150-token prompt through the CPU kernels (int4 target) prefilled in one pass and in chunks of 5, 16 and 37
    tokens: the prompt's logprobs and the greedy continuation's are equal bit for bit."""
    monkeypatch.setenv("SAGUARO_CPU_TIER", cpu_tier)
    model = tiny_model(seed=5, layers=3, sharpness=2.0)
    prompt = [(11 * i + 7) % 64 for i in range(150)]
    params = SamplingParams(max_tokens=12, logprobs=1, prompt_logprobs=1)
    runs = {}
    for chunk in (4096, 5, 16, 37):
        with LLM(model, block_size=4, target_weights="int4", max_prefill_tokens=chunk) as llm:
            assert llm.engine.target.net.tier == cpu_tier
            out = llm.generate([prompt], params)[0]
        runs[chunk] = (out.token_ids, [(p.token, p.logprob) for p in out.prompt_logprobs[1:]],
                       [(p.token, p.logprob) for p in out.logprobs])
    for chunk in (5, 16, 37):
        assert runs[chunk] == runs[4096], chunk
