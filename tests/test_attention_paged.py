"""Per-row paged attention (backends/paged/attention_*.py): torch equals the eager reference, the Triton kernel
equals torch.

The eager reference is ``paged_attention`` over ``build_metadata`` (dense [S, Q, L] mask). Every case
is built twice from the same cache: once as groups with context slots (and tree masks from
``BranchLayout.step_inputs``), once in the per-row form. Block-table entries past a group's length
and extra slots past ``extra_len`` hold out-of-range garbage, so a read of either fails loudly.

The Triton kernel runs on CPU tensors under ``TRITON_INTERPRET=1``. Triton reads that variable when
it is first imported (its library functions are decorated then) and when a kernel is decorated, so
one process cannot switch modes: any earlier test file or plugin may have imported triton already, and
the GPU tests below need the compiler. So the interpreted cases run together in one subprocess that sets
the variable before importing anything, and the tests here compare its outputs with the torch path.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from saguaro.backends.paged.attention_torch import paged_attention_torch
from saguaro.backends.paged.attention_triton import choose_splits, paged_attention_triton
from saguaro.kv.metadata import build_metadata
from saguaro.models.transformer import paged_attention
from saguaro.ssd.tree import BranchLayout

GARBAGE = 1 << 30  # block ids / slots far past any cache: reading one is an index error
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclass
class Case:
    q: torch.Tensor  # [N, H, D]
    k: torch.Tensor  # [slots, KVH, D]
    v: torch.Tensor
    tables: torch.Tensor  # [S, MB] int32
    row_group: torch.Tensor  # [N] int32
    prefix_len: torch.Tensor  # [N] int32
    extra_slots: torch.Tensor  # [N, E] int64
    extra_len: torch.Tensor  # [N] int32
    block_size: int
    scale: float
    expected: torch.Tensor  # [N, H, D]: the eager reference, zeros on ghost rows

    def args(self, device: str = "cpu") -> tuple:
        tensors = (self.q, self.k, self.v, self.tables, self.row_group, self.prefix_len, self.extra_slots,
                   self.extra_len)
        return (*(t.to(device) for t in tensors), self.block_size, self.scale)


class Cache:
    """A random cache of shuffled blocks; ``take(n)`` hands out block ids no one else holds."""

    def __init__(self, blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, gen):
        self.block_size = block_size
        self.free = torch.randperm(blocks, generator=gen).tolist()
        self.k = torch.randn(blocks * block_size, kv_heads, dim, generator=gen).to(dtype)
        self.v = torch.randn(blocks * block_size, kv_heads, dim, generator=gen).to(dtype)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def slots(self, blocks: list[int], length: int) -> list[int]:
        return [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(length)]


def _table(block_lists: list[list[int]]) -> torch.Tensor:
    tables = torch.full((len(block_lists), max(map(len, block_lists)) + 1), GARBAGE, dtype=torch.int32)
    for s, blocks in enumerate(block_lists):
        tables[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return tables


def _finish(cache: Cache, tables, contexts, query_lens, masks, row_group, prefix_len, extras, heads, dtype,
            ghosts, gen) -> Case:
    """Reference output over the groups, then the per-row tensors, with ``ghosts`` padding rows appended."""
    n = sum(query_lens)
    q = torch.randn(n + ghosts, heads, cache.k.shape[2], generator=gen).to(dtype)
    scale = cache.k.shape[2] ** -0.5
    expected = torch.zeros_like(q)
    expected[:n] = paged_attention(q[:n], cache.k, cache.v, build_metadata(contexts, query_lens, masks), scale)
    width = max([len(e) for e in extras] + [0]) + 1  # one garbage column past every row's extras
    extra_slots = torch.full((n + ghosts, width), GARBAGE, dtype=torch.long)
    for r, e in enumerate(extras):
        extra_slots[r, :len(e)] = torch.tensor(e, dtype=torch.long)
    pad = [0] * ghosts
    return Case(q, cache.k, cache.v, tables, torch.tensor(row_group + [1000] * ghosts, dtype=torch.int32),
                torch.tensor(prefix_len + pad, dtype=torch.int32), extra_slots,
                torch.tensor([len(e) for e in extras] + pad, dtype=torch.int32), cache.block_size, scale, expected)


def causal_case(lengths: list[int], query_lens: list[int], block_size: int, dtype=torch.float32, heads: int = 4,
                kv_heads: int = 2, dim: int = 16, ghosts: int = 0, seed: int = 0) -> Case:
    """Group s has ``lengths[s]`` tokens, its last ``query_lens[s]`` new: prefill, decode, verification."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-length // block_size) for length in lengths]
    cache = Cache(sum(needs) + 3, block_size, kv_heads, dim, dtype, gen)
    block_lists = [cache.take(b) for b in needs]
    contexts = [cache.slots(blocks, length) for blocks, length in zip(block_lists, lengths)]
    row_group, prefix_len = [], []
    for s, (length, q) in enumerate(zip(lengths, query_lens)):
        row_group += [s] * q
        prefix_len += list(range(length - q + 1, length + 1))  # a new token sees itself
    return _finish(cache, _table(block_lists), contexts, query_lens, None, row_group, prefix_len,
                   [[] for _ in row_group], heads, dtype, ghosts, gen)


TREES = [  # (verified length L, glued speculation K, fork depths, widths): two sequences' trees in one pass
    (9, 3, [0, 3, 1, 2, 3], [5, 3, 2]),
    (4, 2, [2, 0, 1], []),
]


def tree_case(step: int, block_size: int, dtype=torch.float32, heads: int = 4, kv_heads: int = 2, dim: int = 16,
              ghosts: int = 0, seed: int = 0) -> Case:
    """SSD tree-build step ``step`` of the two trees in ``TREES``; the reference mask is ``step_inputs``'."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(length + k) // block_size) for length, k, _, _ in TREES]
    scratch_blocks = -(-64 // block_size)
    cache = Cache(sum(needs) + scratch_blocks + 3, block_size, kv_heads, dim, dtype, gen)
    block_lists = [cache.take(b) for b in needs]
    scratch = cache.slots(cache.take(scratch_blocks), 64)
    scratch = [scratch[i] for i in torch.randperm(64, generator=gen)]  # scratch slots in no particular order
    contexts, query_lens, masks, row_group, prefix_len, extras = [], [], [], [], [], []
    for s, ((length, k, depths, widths), blocks) in enumerate(zip(TREES, block_lists)):
        layout = BranchLayout(cache.slots(blocks, length + k), length, depths, [0] * len(depths), widths,
                              scratch[32 * s: 32 * (s + 1)])
        context, _, mask = layout.step_inputs(step)
        n = layout.width(step)
        contexts.append(context)
        query_lens.append(n)
        masks.append(mask)
        rows = layout.step_item(step, [0] * n).tree
        prefixes, own = rows.visible, rows.extra_slots
        assert len(prefixes) == n
        row_group += [s] * n
        prefix_len += prefixes
        extras += own
    return _finish(cache, _table(block_lists), contexts, query_lens, masks, row_group, prefix_len, extras,
                   heads, dtype, ghosts, gen)


CASES = {
    "prefill": lambda bs, dt: causal_case([9, 5, 12], [9, 5, 12], bs, dt),
    "chunked_prefill": lambda bs, dt: causal_case([14, 7], [6, 7], bs, dt),
    "decode": lambda bs, dt: causal_case([1, 17, 33, 8], [1, 1, 1, 1], bs, dt),
    "verify": lambda bs, dt: causal_case([6, 21, 13], [5, 5, 5], bs, dt),
    "tree_step0": lambda bs, dt: tree_case(0, bs, dt),
    "tree_step2": lambda bs, dt: tree_case(2, bs, dt),
    "tree_step1": lambda bs, dt: tree_case(1, bs, dt),
    "gqa3_dim24": lambda bs, dt: causal_case([11, 4], [3, 4], bs, dt, heads=6, kv_heads=2, dim=24),
    "mha": lambda bs, dt: causal_case([10, 3], [2, 3], bs, dt, heads=2, kv_heads=2),
    "gqa6_ghosts": lambda bs, dt: causal_case([5, 19], [1, 5], bs, dt, heads=12, kv_heads=2, ghosts=3),
    "tree_ghosts": lambda bs, dt: tree_case(2, bs, dt, ghosts=2),
    "long": lambda bs, dt: causal_case([700, 150], [1, 4], bs, dt),  # many tiles per program on a GPU
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", CASES)
def test_torch_matches_eager_reference(name, block_size, dtype):
    case = CASES[name](block_size, DTYPES[dtype])
    out = paged_attention_torch(*case.args())
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out, case.expected, **TOL[DTYPES[dtype]])
    ghost = (case.prefix_len == 0) & (case.extra_len == 0)
    assert torch.equal(out[ghost], torch.zeros_like(out[ghost]))


def test_negative_control_tree_rows_without_their_own_tokens_differ():
    case = tree_case(2, 4)
    args = list(case.args())
    args[7] = torch.zeros_like(args[7])  # branches that no longer see their own scratch tokens
    assert not torch.allclose(paged_attention_torch(*args), case.expected, **TOL[torch.float32])


def test_torch_writes_into_out_and_handles_no_rows():
    case = causal_case([7, 3], [2, 3], 4)
    out = torch.full_like(case.q, float("nan"))
    assert paged_attention_torch(*case.args(), out=out) is out
    torch.testing.assert_close(out, case.expected, **TOL[torch.float32])
    empty = causal_case([3], [1], 4)
    args = list(empty.args())
    args[0], args[4], args[5], args[6], args[7] = (args[0][:0], args[4][:0], args[5][:0], args[6][:0], args[7][:0])
    assert paged_attention_torch(*args).shape == (0, 4, 16)


def test_bad_arguments_are_rejected():
    case = causal_case([7, 3], [2, 3], 4)
    args = list(case.args())
    with pytest.raises(ValueError, match="heads"):
        paged_attention_torch(args[0][:, :3], *args[1:])
    with pytest.raises(ValueError, match="share"):
        paged_attention_torch(args[0].bfloat16(), *args[1:])
    with pytest.raises(ValueError, match="prefix_len"):
        paged_attention_torch(*args[:5], args[5][:1], *args[6:])
    too_long = args[5].clone()
    too_long[0] = args[3].shape[1] * 4 + 1
    with pytest.raises(ValueError, match="exceeds the block table"):
        paged_attention_torch(*args[:5], too_long, *args[6:])


def test_choose_splits_fills_the_gpu_from_shapes_only():
    # batch-1 decode on 132 SMs at Qwen2.5's 2 kv heads: far more than KVH programs
    assert 2 * choose_splits(1, 2, 4096, 132) >= 128
    assert choose_splits(1, 2, 256, 132) == 256 // 64  # a short table caps the splits
    assert choose_splits(66, 2, 4096, 132) == 1  # enough rows already: no combine pass
    assert choose_splits(1, 1, 1 << 20, 10_000) == 64


# --- the Triton kernel, interpreted on the CPU ------------------------------------------------------------------

# (case, block size, dtype, splits); the interpreter takes tiles of 16 positions, so these cross tiles and splits
TRITON_RUNS = [(name, 4, "fp32", 3) for name in CASES if name not in ("prefill", "long")] + [
    (name, 4, "fp32", 1) for name in ("prefill", "decode", "tree_step2", "gqa6_ghosts")] + [
    (name, bs, dtype, splits) for name in ("chunked_prefill", "decode", "tree_step2", "gqa6_ghosts")
    for bs, dtype, splits in ((1, "fp32", 2), (16, "fp32", 1), (4, "bf16", 2), (16, "bf16", 1))]


def run_interpreted(path: str) -> None:
    """In the subprocess (TRITON_INTERPRET=1 set before any import): every run's output, or its error, to ``path``."""
    results = {}
    for run in TRITON_RUNS:
        name, block_size, dtype, splits = run
        case = CASES[name](block_size, DTYPES[dtype])
        try:
            results[run] = paged_attention_triton(*case.args(), out=torch.full_like(case.q, float("nan")),
                                                  num_splits=splits)
        except Exception as e:  # noqa: BLE001 -- reported by that run's test
            results[run] = f"{type(e).__name__}: {e}"
    torch.save(results, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("interpreted") / "outputs.pt"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    code = "import sys; from tests.test_attention_paged import run_interpreted; run_interpreted(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"interpreter subprocess failed:\n{done.stderr[-3000:]}"
    return torch.load(path)


@pytest.mark.parametrize("run", TRITON_RUNS, ids=["-".join(map(str, r)) for r in TRITON_RUNS])
def test_triton_interpreted_matches_torch(interpreted, run):
    name, block_size, dtype, splits = run
    out = interpreted[run]
    assert not isinstance(out, str), out
    case = CASES[name](block_size, DTYPES[dtype])
    expected = paged_attention_torch(*case.args())
    tol = TOL[torch.float32] if dtype == "fp32" else dict(atol=1e-2, rtol=1e-2)  # bf16: an ulp of the rounding
    torch.testing.assert_close(out, expected, **tol)
    ghost = (case.prefix_len == 0) & (case.extra_len == 0)
    assert torch.equal(out[ghost], torch.zeros_like(out[ghost]))


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = causal_case([3], [1], 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        paged_attention_triton(*case.args())


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path is not None
    except Exception:  # noqa: BLE001 -- no nvidia backend in this triton build
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas is missing")
@pytest.mark.parametrize("dtype,heads,dim,splits", [(torch.bfloat16, 12, 128, 8), (torch.bfloat16, 12, 128, 1),
                                                     (torch.float32, 6, 24, 3)])
def test_triton_kernels_compile_for_hopper(dtype, heads, dim, splits):
    # the interpreter skips the compiler's checks (loop-carried types, dot shapes), so compile for sm_90 here too
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from saguaro.backends.paged import attention_kernels
    from saguaro.backends.paged.attention_triton import kernel_constants

    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    types = dict(q_ptr=pointer, k_ptr=pointer, v_ptr=pointer, out_ptr=pointer, tables_ptr="*i32", row_group_ptr="*i32",
                 prefix_len_ptr="*i32", extra_slots_ptr="*i64", extra_len_ptr="*i32", part_acc_ptr="*fp32",
                 part_max_ptr="*fp32", part_sum_ptr="*fp32", scale_log2="fp32")
    split_constants, combine_constants = kernel_constants(dtype, heads, 2, dim, 16, splits, interpret=False)
    for fn, constants in ((attention_kernels.split_kernel, split_constants),
                          (attention_kernels.combine_kernel, combine_constants)):
        constants = dict(constants)
        warps = constants.pop("num_warps")
        names = list(fn.arg_names)
        signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
        source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert kernel.asm["cubin"]


# --- on a GPU ----------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.gpu
@needs_cuda
def test_triton_on_cuda_matches_torch(name, splits, dtype):
    case = CASES[name](16, DTYPES[dtype])
    expected = paged_attention_torch(*case.args())
    out = paged_attention_triton(*case.args("cuda"), num_splits=splits)
    tol = TOL[torch.float32] if dtype == "fp32" else TOL[torch.bfloat16]  # bf16: P is rounded before P @ V
    torch.testing.assert_close(out.cpu(), expected, **tol)


@pytest.mark.gpu
@needs_cuda
def test_triton_replays_in_a_cuda_graph_with_new_lengths():
    case = causal_case([300, 500, 77], [1, 5, 1], 16, torch.bfloat16, heads=12, kv_heads=2, dim=128, ghosts=1)
    q, k, v, tables, row_group, prefix_len, extra_slots, extra_len, block_size, scale = case.args("cuda")
    out = torch.empty_like(q)
    call = lambda: paged_attention_triton(q, k, v, tables, row_group, prefix_len, extra_slots, extra_len,
                                          block_size, scale, out=out)
    call()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), case.expected, **TOL[torch.bfloat16])
    # the next round: every row moves on (the last new row of group 1 and the ghost become real rows)
    new_prefix = torch.tensor([301, 260, 261, 262, 263, 264, 78, 40], dtype=torch.int32)
    new_group = torch.tensor([0, 1, 1, 1, 1, 1, 2, 0], dtype=torch.int32)
    prefix_len.copy_(new_prefix)
    row_group.copy_(new_group)
    q.copy_(torch.randn(q.shape).to(q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_attention_torch(q.cpu(), *case.args()[1:4], new_group, new_prefix, *case.args()[6:])
    torch.testing.assert_close(out.cpu(), expected, **TOL[torch.bfloat16])
