"""The bf16 fast path (packed weights + C++ kernels) against the eager model.

Kernels are checked one by one against fp32 references, then the whole forward pass
against eager bf16 on every attention shape the engine produces (prefill, decode, K+1
verification, mixed batches, tree-branch masks), then through the engine. fp32 models
must never take the fast path, so their greedy outputs stay exactly the eager ones.

Kernel and forward tests run on every kernel tier this CPU executes (``cpu_tier``: an AVX-512 machine
tests avx512, avx2 and portable; an AVX2 one avx2 and portable). The first run builds each tier's C++
extension (about a minute on a 2-core machine, once; later runs load it from the torch extensions cache).
"""
import pytest
import torch
import torch.nn.functional as F

from saguaro import LLM, SamplingParams
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.backends.cpu_kernels import build as kernels
from saguaro.models.model_config import ModelConfig
from saguaro.backends.cpu_kernels.model import FastCausalLM, fast_or_eager, unsupported_reason
from saguaro.models.transformer import CausalLM, paged_attention
from tests.tiny import tiny_model

@pytest.fixture(scope="module")
def ops(cpu_tier):
    return kernels.load(cpu_tier)


def random_model(arch: str = "qwen2", tie: bool = False, head_dim: int = 32, seed: int = 0) -> CausalLM:
    cfg = ModelConfig(arch=arch, vocab_size=100, hidden_size=4 * head_dim, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=head_dim, max_position_embeddings=512,
                      attention_bias=arch == "qwen2", tie_word_embeddings=tie, qk_norm=arch == "qwen3")
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    return model.eval().requires_grad_(False).to(torch.bfloat16)


def pack(ops, *weights, epilogue=0):
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    dst = torch.empty(-(-n // 64), k // 2, 64, 2, dtype=torch.bfloat16)
    ops.pack(dst, list(weights), epilogue)
    return dst


# -- kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 9, 16, 40])
@pytest.mark.parametrize("n,k", [(64, 32), (100, 96), (300, 2050)])
def test_gemm_matches_fp32_reference(ops, m, n, k):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    bias, res = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16()
    ref = x.float() @ w.float().T
    packed = pack(ops, w)
    got = ops.gemm(x, packed, n, None, None, 0, True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3 * k ** 0.5)
    with_bias = ops.gemm(x, packed, n, bias, None, 0, False)
    torch.testing.assert_close(with_bias.float(), (ref + bias.float()).bfloat16().float(), rtol=0.02, atol=0.05)
    with_res = ops.gemm(x, packed, n, None, res, 0, False)
    torch.testing.assert_close(with_res.float(), (res.float() + ref.bfloat16().float()), rtol=0.02, atol=0.05)


def test_round_bf16_epilogue_gives_bf16_values_in_fp32(ops):
    torch.manual_seed(1)
    x, w = torch.randn(3, 96).bfloat16(), torch.randn(130, 96).bfloat16()
    exact = ops.gemm(x, pack(ops, w), 130, None, None, 0, True)
    rounded = ops.gemm(x, pack(ops, w), 130, None, None, 2, True)
    assert rounded.dtype == torch.float32
    assert torch.equal(rounded, exact.bfloat16().float())


@pytest.mark.parametrize("m", [1, 3])
def test_epilogue_bits_are_the_plain_expressions(ops, m):
    """Bias, residual and bf16 rounding (vectorized loops) give the bits of v + bias rounded as torch rounds it,
    NaN and infinities included, for one row and several."""
    torch.manual_seed(m)
    n = 200  # a partial last tile
    x, w = torch.randn(m, 96).bfloat16(), torch.randn(n, 96).bfloat16()
    bias, res = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16()
    bias[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    packed = pack(ops, w)
    summed = ops.gemm(x, packed, n, bias, None, 0, True)  # fp32 v + bias, no rounding
    assert torch.equal(summed.isnan(), bias.isnan().expand(m, n))

    def same(got, want):  # bit for bit, but any NaN for a NaN (torch's and c10's NaN bits differ)
        assert torch.equal(got.isnan(), want.isnan())
        ints = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(ints)[~got.isnan()], want.view(ints)[~want.isnan()])
    same(ops.gemm(x, packed, n, bias, None, 0, False), summed.bfloat16())
    same(ops.gemm(x, packed, n, bias, None, 2, True), summed.bfloat16().float())
    same(ops.gemm(x, packed, n, bias, res, 0, False), (res.float() + summed.bfloat16().float()).bfloat16())


def test_gemm_strided_rows_and_stacked_sources(ops):
    torch.manual_seed(0)
    x = torch.randn(3, 200).bfloat16()[:, :128]  # row stride 200
    a, b = torch.randn(40, 128).bfloat16(), torch.randn(30, 128).bfloat16()
    got = ops.gemm(x, pack(ops, a, b), 70, None, None, 0, True)
    torch.testing.assert_close(got, x.float() @ torch.cat((a, b)).float().T, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("m", [1, 4, 9])
def test_swiglu_epilogue(ops, m):
    torch.manual_seed(m)
    x, gate, up = torch.randn(m, 64).bfloat16(), torch.randn(96, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    got = ops.gemm(x, pack(ops, gate, up, epilogue=1), 192, None, None, 1, False)
    ref = F.silu(F.linear(x, gate)) * F.linear(x, up)  # eager MLP rounding
    assert got.shape == (m, 96)
    torch.testing.assert_close(got.float(), ref.float(), rtol=0.02, atol=0.05)


def test_rms_norm_matches_module(ops):
    model = random_model()
    norm = model.model.norm
    x = torch.randn(5, model.config.hidden_size).bfloat16()
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps).float(), norm(x).float(), rtol=0.01, atol=0.02)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_attention_with_tree_mask(ops, head_dim):
    torch.manual_seed(head_dim)
    heads, kv_heads, slots = 6, 2, 300
    k_cache, v_cache = torch.randn(2, slots, kv_heads, head_dim).bfloat16()
    # group 0: 3 verification tokens over 40 slots; group 1: 5 tree branches, each sees 60 slots and itself
    contexts = [list(range(100, 140)), list(range(200, 260)) + list(range(270, 275))]
    tree = torch.zeros(5, 65, dtype=torch.bool)
    tree[:, :60] = True
    tree[torch.arange(5), 60 + torch.arange(5)] = True
    causal = torch.ones(3, 40, dtype=torch.bool).tril(37)
    meta = build_metadata(contexts, [3, 5], [causal, tree])
    q = torch.randn(8, heads, head_dim).bfloat16()
    qkv = torch.cat((q.view(8, -1), torch.zeros(8, 2 * kv_heads * head_dim, dtype=torch.bfloat16)), 1)
    ref = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, head_dim ** -0.5)
    got = ops.attention(qkv, k_cache, v_cache, meta.query_index, meta.query_valid, meta.context_slots, meta.mask,
                        heads, kv_heads, head_dim, head_dim ** -0.5)
    torch.testing.assert_close(got.float().view(8, heads, head_dim), ref, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("heads,head_dim", [(14, 64), (6, 16), (4, 128)])
def test_a_querys_attention_bits_do_not_depend_on_the_queries_beside_it(ops, heads, head_dim):
    """Verification rows share work items (a kv head's keys read once for several (query, head) lanes), and a
    query sees fewer keys than the group's longest: each row must still equal that query attended alone, bit
    for bit, as a decode step would give it. 14 heads over 2 kv heads put 7 lanes per query: 3 queries cross
    a block of 8 lanes."""
    torch.manual_seed(heads)
    kv_heads, slots = 2, 200
    k_cache, v_cache = torch.randn(2, slots, kv_heads, head_dim).bfloat16()
    context = list(range(20, 120))
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim).bfloat16()

    def attend(rows: torch.Tensor, contexts, masks) -> torch.Tensor:
        meta = build_metadata(contexts, [len(m) for m in masks], masks)
        return ops.attention(rows, k_cache, v_cache, meta.query_index, meta.query_valid, meta.context_slots,
                             meta.mask, heads, kv_heads, head_dim, head_dim ** -0.5)

    together = attend(qkv, [context], [torch.ones(3, 100, dtype=torch.bool).tril(97)])
    for q in range(3):
        alone = attend(qkv[q:q + 1], [context[:98 + q]], [torch.ones(1, 98 + q, dtype=torch.bool)])
        assert torch.equal(together[q], alone[0]), f"query {q}"


# -- whole forward pass ---------------------------------------------------------------------

def run_both(model, fast, steps):
    """Feed the same steps to eager and fast, each with its own cache; compare every step."""
    caches = [KVCache(model.config, 32, 16, torch.bfloat16) for _ in range(2)]
    torch.manual_seed(0)
    for contexts, qlens, masks in steps:
        meta = build_metadata(contexts, qlens, masks)
        ids = torch.randint(0, model.config.vocab_size, (sum(qlens),))
        pos = torch.cat([torch.arange(len(c) - q, len(c)) for c, q in zip(contexts, qlens)])
        with torch.inference_mode():
            h_eager, h_fast = model(ids, pos, caches[0], meta), fast(ids, pos, caches[1], meta)
            l_eager, l_fast = model.logits(h_eager), fast.logits(h_fast)
        scale = h_eager.float().abs().max()
        assert (h_fast.float() - h_eager.float()).abs().max() <= 0.03 * scale
        assert (l_fast - l_eager).abs().max() <= 0.03 * l_eager.abs().max()
        assert (l_fast.argmax(-1) == l_eager.argmax(-1)).float().mean() >= 0.9
        assert (caches[1].data.float() - caches[0].data.float()).abs().max() <= 0.05 * caches[0].data.abs().max()


TREE = torch.zeros(4, 45, dtype=torch.bool)
TREE[:, :41] = True
TREE[torch.arange(4), 41 + torch.arange(4)] = True
STEPS = [
    ([list(range(20))], [20], None),  # prefill
    ([list(range(21))], [1], None),  # decode
    ([list(range(26))], [5], None),  # K+1 verification
    ([list(range(100, 110)), list(range(200, 217))], [10, 17], None),  # two prefills
    ([list(range(100, 111)), list(range(200, 218))], [1, 1], None),  # batched decode
    ([list(range(41)) + list(range(300, 304))], [4], [TREE]),  # tree branches
]


@pytest.mark.parametrize("arch,tie,head_dim", [("qwen2", False, 32), ("llama", True, 16), ("qwen2", False, 64),
                                               ("qwen3", True, 32)])
def test_fast_forward_matches_eager(arch, tie, head_dim, cpu_tier):
    model = random_model(arch, tie, head_dim)
    fast = FastCausalLM(model, tier=cpu_tier)
    assert fast.tier == cpu_tier
    run_both(model, fast, STEPS)


def test_fused_layers_equal_stepwise_reference():
    model = random_model()
    fast = FastCausalLM(model)
    meta = build_metadata([list(range(30))], [30])
    ids, pos = torch.randint(0, 100, (30,)), torch.arange(30)
    a, b = KVCache(model.config, 8, 16, torch.bfloat16), KVCache(model.config, 8, 16, torch.bfloat16)
    assert torch.equal(fast.forward_stepwise(ids, pos, a, meta), fast(ids, pos, b, meta))
    assert torch.equal(a.data, b.data)


def test_threads_do_not_change_results():
    model = random_model()
    fast = FastCausalLM(model)
    meta = build_metadata([list(range(40)), list(range(100, 125))], [40, 25])
    ids, pos = torch.randint(0, 100, (65,)), torch.cat((torch.arange(40), torch.arange(25)))
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cache = KVCache(model.config, 16, 16, torch.bfloat16)
            outs.append(fast.logits(fast(ids, pos, cache, meta)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


# -- engine -------------------------------------------------------------------------------

def test_fp32_never_takes_the_fast_path():
    loaded = tiny_model(seed=1)
    assert unsupported_reason(loaded.model) is not None
    assert fast_or_eager(loaded.model) is loaded.model
    runner = ModelRunner(loaded.model, 16, 4, enforce_eager=False)
    assert runner.net is loaded.model


def test_greedy_fp32_outputs_unchanged_on_the_fast_path():
    prompts = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7]]
    params = SamplingParams(max_tokens=10)
    off = LLM(tiny_model(seed=3), block_size=4, kv_cache_tokens=256, enforce_eager=True).generate(prompts, params)
    on = LLM(tiny_model(seed=3), block_size=4, kv_cache_tokens=256).generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_bf16_engine_runs_fast_and_agrees_with_eager():
    prompts = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7, 8]]
    params = SamplingParams(max_tokens=8)
    fast_llm = LLM(tiny_model(seed=4, sharpness=8.0), dtype="bfloat16", block_size=4, kv_cache_tokens=256)
    assert isinstance(fast_llm.engine.target.net, FastCausalLM)
    eager_llm = LLM(tiny_model(seed=4, sharpness=8.0), dtype="bfloat16", block_size=4, kv_cache_tokens=256,
                    enforce_eager=True)
    fast_out, eager_out = fast_llm.generate(prompts, params), eager_llm.generate(prompts, params)
    # bf16 rounding may flip a near-tie; a sharp head makes that rare, so most tokens agree
    agree = sum(a == b for f, e in zip(fast_out, eager_out) for a, b in zip(f.token_ids, e.token_ids))
    assert agree >= 0.8 * sum(len(o.token_ids) for o in eager_out)


def test_runner_logits_rows_match_eager():
    model = random_model()
    logits = []
    for runner in (ModelRunner(model, 16, 4), ModelRunner(model, 16, 4, enforce_eager=False)):
        table: list[int] = []
        runner.blocks.reserve(table, 9)
        logits.append(runner.forward([ForwardItem(list(range(1, 10)), 0, table, "all")])[0])
        assert isinstance(runner.net, FastCausalLM) == (len(logits) == 2)
    eager, fast = logits
    assert eager.shape == fast.shape == (9, 100)
    assert (fast - eager).abs().max() <= 0.03 * eager.abs().max()
