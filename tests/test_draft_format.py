"""Cheaper drafts: int8 / int4 weights (W8A8 / W4A8 kernels) and a reduced draft head stay lossless.

The int8 kernels are checked against fp32 references within int8 accuracy, the int4 kernels
against an exact reference of their quantization (to fp32 rounding); the draft formats
are checked where exactness lives: greedy SD/SSD equal AR token for token with an fp32
target, and SD/SSD at temperature 1 sample the target's exact law (50,000 samples, the
threshold derived in tests/dist_harness.py). Kernel and model tests run on every kernel tier this CPU
executes (``cpu_tier``); the engine tests on the default (best) tier.
"""
import copy

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.backends.cpu_kernels import build as kernels
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.models.draft_format import DraftFormat
from tests.dist_harness import measure
from tests.tiny import PROMPTS, greedy_tokens, perturbed, tiny_model, truncated

@pytest.fixture(scope="module")
def ops(cpu_tier):
    return kernels.load(cpu_tier)


@pytest.fixture
def on_tier(cpu_tier, monkeypatch):
    """Models built in this test (and processes it starts) take the kernels of ``cpu_tier``."""
    monkeypatch.setenv(kernels.ENV, cpu_tier)
    return cpu_tier


def pack_i8(ops, *weights, epilogue=0):
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    dst = torch.empty(-(-n // 64), k // 4 + 4, 64, 4, dtype=torch.uint8)
    ops.pack_i8(dst, list(weights), epilogue)
    return dst


def pack_i4(ops, *weights, epilogue=0):
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    dst = torch.empty(-(-n // 64), k // 32, ops.I4_BLOCK, dtype=torch.uint8)
    ops.pack_i4(dst, list(weights), epilogue)
    return dst


def _safe_inverse(x: torch.Tensor, numerator: float) -> torch.Tensor:
    """numerator / x in fp32 true division as C++ computes it (not torch's reciprocal-times), 0 where x is 0."""
    return torch.where(x > 0, torch.full_like(x, numerator) / torch.where(x > 0, x, 1), torch.zeros_like(x))


def int4_reference(w: torch.Tensor) -> torch.Tensor:
    """The int4 weights as the kernel sees them: per 32 inputs, 16 levels from min to max, s and z in fp16."""
    g = w.float().view(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s, z = ((hi - lo) / 15).half().float(), lo.half().float()
    return (((g - z) * _safe_inverse(s, 1.0)).round().clamp(0, 15) * s + z).view_as(w)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the quantized kernels see it: int8 per 32 values, scale absmax / 127."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    return ((g * _safe_inverse(amax, 127.0)).round() * (amax / 127)).view_as(x)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


# -- kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize("n,k", [(64, 32), (100, 96), (300, 2080), (130, 4096)])
def test_int8_gemm_within_int8_accuracy(ops, m, n, k):
    """Per-channel int8 weights and per-32 int8 activations: ~1% relative error on Gaussian data."""
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    x[:, 5] *= 30  # an outlier channel, as real hidden states have: per-block scales contain it
    ref = x.float() @ w.float().T
    packed = pack_i8(ops, w)
    assert rel_err(ops.gemm(x, packed, n, None, None, 0, True), ref) < 0.02
    bias, res = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16()
    assert rel_err(ops.gemm(x, packed, n, bias, None, 0, False), ref + bias.float()) < 0.02
    assert rel_err(ops.gemm(x, packed, n, None, res, 0, False), ref + res.float()) < 0.02


def test_int8_swiglu_epilogue(ops):
    torch.manual_seed(0)
    x, gate, up = torch.randn(5, 64).bfloat16(), torch.randn(96, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    ref = torch.nn.functional.silu(x.float() @ gate.float().T) * (x.float() @ up.float().T)
    got = ops.gemm(x, pack_i8(ops, gate, up, epilogue=1), 192, None, None, 1, False)
    assert got.shape == (5, 96) and rel_err(got, ref) < 0.03


def test_int8_zero_rows_and_padding(ops):
    w = torch.zeros(70, 64).bfloat16()
    w[3] = 1.0
    out = ops.gemm(torch.ones(2, 64).bfloat16(), pack_i8(ops, w), 70, None, None, 0, True)
    assert out.shape == (2, 70) and torch.all(out[:, 3] == 64) and torch.count_nonzero(out) == 2


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize("n,k", [(64, 32), (100, 96), (300, 2080), (130, 4096)])
def test_int4_gemm_equals_its_quantization(ops, m, n, k):
    """W4A8 computes exactly (to fp32 rounding) the product of its quantized weights and activations,
    and lands within int4 accuracy of the bf16 product."""
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    x[:, 5] *= 30
    packed = pack_i4(ops, w)
    exact = int8_activations(x).double() @ int4_reference(w).double().T
    got = ops.gemm(x, packed, n, None, None, 0, True)
    assert rel_err(got.double(), exact) < 1e-5
    assert rel_err(got, x.float() @ w.float().T) < 0.12  # 16 levels per group of Gaussian weights
    bias, res = torch.randn(n).bfloat16(), torch.randn(m, n).bfloat16()
    assert rel_err(ops.gemm(x, packed, n, bias, None, 0, False), exact.float() + bias.float()) < 0.01
    assert rel_err(ops.gemm(x, packed, n, None, res, 0, False), exact.float() + res.float()) < 0.01


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(ops, weights):
    """AR computes a row alone; SD's verification computes it among K others, in wider register tiles (avx512's
    int4 takes 4 rows in one pass of its own kernel) and, past a tile, in k blocks: every row's bits must be
    the same, or greedy speculation could differ from AR. Every row count up to 13 (each split of the rows into
    register tiles), K long enough for k blocks, with a bias and a residual, and SwiGLU."""
    torch.manual_seed(13)
    n, k = 192, 2560
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    if weights == "bf16":
        packed = torch.empty(n // 64, k // 2, 64, 2, dtype=torch.bfloat16)
        ops.pack(packed, [w], 0)
        swiglu = torch.empty(n // 64, k // 2, 64, 2, dtype=torch.bfloat16)
        ops.pack(swiglu, [w[:n // 2], w[n // 2:]], 1)
    else:
        pack = pack_i8 if weights == "int8" else pack_i4
        packed, swiglu = pack(ops, w), pack(ops, w[:n // 2], w[n // 2:], epilogue=1)
    for m in range(1, 14):
        x, res = torch.randn(m, k).bfloat16(), torch.randn(m, n).bfloat16()
        together = [ops.gemm(x, packed, n, None, None, 0, True), ops.gemm(x, packed, n, bias, res, 0, False),
                    ops.gemm(x, swiglu, n, None, None, 1, False)]
        for i in range(m):
            alone = [ops.gemm(x[i:i + 1], packed, n, None, None, 0, True),
                     ops.gemm(x[i:i + 1], packed, n, bias, res[i:i + 1], 0, False),
                     ops.gemm(x[i:i + 1], swiglu, n, None, None, 1, False)]
            assert all(torch.equal(t[i:i + 1], a) for t, a in zip(together, alone)), (m, i)


def test_int4_weights_on_a_4bit_grid_are_kept_exactly(ops):
    """Weights already on a per-group 16-level grid (as GGUF Q4 blocks are) pack without loss."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (128, 256)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans its whole grid
    scale = 2.0 ** -torch.randint(4, 9, (128, 8, 1)).float()  # powers of two: the grid survives bf16
    offset = torch.randint(-40, 20, (128, 8, 1)).float() * scale
    w = (codes.view(128, 8, 32) * scale + offset).view(128, 256).bfloat16()
    assert torch.equal(int4_reference(w), w.float())
    x = torch.randn(3, 256).bfloat16()
    got = ops.gemm(x, pack_i4(ops, w), 128, None, None, 0, True)
    assert rel_err(got.double(), int8_activations(x).double() @ w.double().T) < 1e-5


def test_int4_swiglu_epilogue_and_padding(ops):
    torch.manual_seed(0)
    x, gate, up = torch.randn(5, 64).bfloat16(), torch.randn(96, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    xq, g4, u4 = int8_activations(x), int4_reference(gate), int4_reference(up)
    ref = torch.nn.functional.silu(xq @ g4.T) * (xq @ u4.T)
    got = ops.gemm(x, pack_i4(ops, gate, up, epilogue=1), 192, None, None, 1, False)
    assert got.shape == (5, 96) and rel_err(got, ref) < 0.01
    w = torch.zeros(70, 64).bfloat16()
    w[3] = 1.0
    out = ops.gemm(torch.ones(2, 64).bfloat16(), pack_i4(ops, w), 70, None, None, 0, True)
    assert out.shape == (2, 70) and torch.all(out[:, 3] == 64) and torch.count_nonzero(out) == 2


# -- the model with a draft format ----------------------------------------------------------

def bf16_model(vocab=100, seed=0):
    return tiny_model(seed=seed, vocab=vocab, hidden=64).model.to(torch.bfloat16)


def logits_of(model, ids, **fast):
    """Logits of every position of ``ids`` through a fast-path runner with ``fast`` (weights, head_ids)."""
    runner = ModelRunner(model, 8, 16, enforce_eager=False, **fast)
    table = []
    runner.blocks.reserve(table, len(ids))
    return runner.forward([ForwardItem(ids, 0, table, "all")])[0]


@pytest.mark.parametrize("keep", [[0, 1, 2, 5, 50, 99], [3, 7, 99], list(range(40))],
                         ids=["a run then scattered", "no run", "only a run"])
def test_reduced_head_keeps_exact_logits_and_masks_the_rest(on_tier, keep):
    model = bf16_model()
    keep = torch.tensor(keep)
    a, b = logits_of(model, [3, 4, 5, 6]), logits_of(model, [3, 4, 5, 6], head_ids=keep)
    assert torch.equal(b[:, keep], a[:, keep])
    dropped = torch.ones(100, dtype=torch.bool)
    dropped[keep] = False
    assert torch.all(torch.isneginf(b[:, dropped]))


def test_int8_model_close_to_bf16(on_tier):
    model = bf16_model()
    ids = [3, 14, 15, 9, 26, 5]
    a, b = logits_of(model, ids), logits_of(model, ids, weights="int8")
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98


def test_int4_model_runs_its_quantized_weights(on_tier):
    """Every matrix (qkv, o, SwiGLU gate/up, down, head) goes through int4: the int4 model is the bf16
    model with each matrix replaced by its int4 grid, up to int8 activation rounding."""
    model = bf16_model()
    assert not model.config.tie_word_embeddings  # so the head can be quantized without the embedding
    grid = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in grid.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(int4_reference(p).bfloat16())
    ids = [3, 14, 15, 9, 26, 5]
    a, b = logits_of(grid, ids), logits_of(model, ids, weights="int4")
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98


def test_draft_format_without_the_fast_path_is_an_error():
    fp32 = tiny_model(vocab=100, hidden=64).model  # the fast path is bf16 only
    with pytest.raises(ValueError, match="need the fast path"):
        ModelRunner(fp32, 8, 16, enforce_eager=False, weights="int8")


def test_head_ids_keep_prefix_and_special_tokens():
    draft = tiny_model(vocab=64, eos=60)
    assert DraftFormat("int8", 10).head_ids(draft).tolist() == list(range(10)) + [60]
    assert DraftFormat().head_ids(draft) is None and not DraftFormat().custom


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="draft_weights"):
        LLM(target=tiny_model(), draft=tiny_model(seed=1), mode="sd", draft_weights="int3")
    with pytest.raises(ValueError, match="draft_vocab"):
        LLM(target=tiny_model(), draft=tiny_model(seed=1), mode="sd", draft_vocab=0)


# -- exactness --------------------------------------------------------------------------------

FORMATS = [dict(draft_weights="int8"), dict(draft_weights="int4"), dict(draft_weights="int8", draft_vocab=40),
           dict(draft_vocab=20)]


@pytest.mark.parametrize("fmt", FORMATS, ids=["int8", "int4", "int8-vocab40", "bf16-vocab20"])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_equals_ar_with_cheap_draft(fmt, mode):
    """fp32 target, draft run int8 / reduced head in bf16: output equals AR token for token."""
    target = tiny_model(seed=3, vocab=64, layers=3, sharpness=2.0)
    draft = truncated(target, 2)
    expected = greedy_tokens(target, PROMPTS, 24)
    extra = dict(fan_out=[1, 1, 1, 2]) if mode == "ssd" else {}
    with LLM(target=target, draft=draft, mode=mode, num_speculative_tokens=3, **extra, **fmt) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
        metrics = llm.spec_metrics(outs)
    assert [o.token_ids for o in outs] == expected
    assert 0 < metrics.acceptance_rate < 1


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=5, vocab=16, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.03)


@pytest.mark.parametrize("mode,weights", [("sd", "int8"), ("ssd", "int8"), ("ssd", "int4")])
def test_distribution_with_quantized_reduced_head_draft(pair, mode, weights):
    """T = 1: the draft can never propose ids 12..15 (q = 0) and computes q in int8/int4; the law is exact."""
    extra = dict(fan_out=[2, 3]) if mode == "ssd" else {}
    llm = LLM(target=pair[0], draft=pair[1], mode=mode, num_speculative_tokens=1 if mode == "ssd" else 3,
              draft_weights=weights, draft_vocab=12, block_size=4, max_num_seqs=1024, kv_cache_tokens=1024 * 16,
              **extra)
    with llm:
        tv, threshold = measure(llm, pair[0], SamplingParams(temperature=1.0), positions=[0, 1])
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
