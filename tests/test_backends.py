"""The backend seam on the CPU: pass preparation and the CUDA-graph bookkeeping, without a GPU.

* Both metadata forms state the same attention: for every row of causal passes (prefill, decode,
  verification) and of SSD tree steps (``BranchLayout.step_item``), the set of cache slots a row sees is
  the same in the dense form, the paged form, and ``BranchLayout.step_inputs``' mask.
* ``GraphRunner`` with ``EagerCapture`` (the CPU stand-in for CUDA graphs) runs the same static-buffer code
  a GPU replays: passes are padded to their bucket with ghost rows that write nothing and see nothing, each
  bucket keeps one set of buffers that every replay reuses, a smaller pass after a larger one resets the rows
  it does not use, and results equal an unpadded call.
"""
import pytest
import torch

from saguaro.backends.batch import ForwardItem, TreeRows
from saguaro.backends.dense import dense_metadata
from saguaro.backends.paged.graphs import EagerCapture, GraphRunner, bucket_for
from saguaro.backends.paged.metadata import paged_metadata
from saguaro.kv.block_manager import slots_for
from saguaro.kv.kv_cache import KVCache
from saguaro.ssd.tree import BranchLayout
from tests.tiny import tiny_model

BS = 4


def dense_sets(items):
    meta = dense_metadata(items, BS)
    out = []
    for s, item in enumerate(items):
        for q in range(len(item.token_ids)):
            ctx, mask = meta.context_slots[s].tolist(), meta.mask[s, q].tolist()
            out.append({c for c, m in zip(ctx, mask) if m})
    return out, meta.slot_mapping.tolist()


def paged_sets(items):
    meta = paged_metadata(items, BS)
    out = []
    for r in range(meta.num_rows):
        table = [b for b in meta.block_tables[int(meta.row_group[r])].tolist()]
        seen = set(slots_for(table, 0, int(meta.prefix_len[r]), BS))
        seen |= set(meta.extra_slots[r, :int(meta.extra_len[r])].tolist())
        out.append(seen)
    return out, meta.slot_mapping.tolist()


def causal_items():
    a, b = list(range(0, 5)), list(range(5, 9))  # block tables covering 20 and 16 positions
    return [ForwardItem([1, 2, 3, 4, 5, 6, 7], 0, a, "last"),  # prefill
            ForwardItem([9], 11, b, "last"),  # decode
            ForwardItem([3, 4, 5, 6, 7], 13, a, "all")]  # K+1 verification


def tree_layout(widths):
    table = list(range(10, 14))  # 16 positions
    layout = BranchLayout(slots_for(table, 0, 9, BS), 6, [0, 2, 1, 3], [5, 6, 7, 8], widths, block_table=table)
    layout.scratch_slots = list(range(200, 200 + layout.scratch_size(3)))
    return layout


def test_causal_passes_see_the_same_slots_in_both_forms():
    d, d_slots = dense_sets(causal_items())
    p, p_slots = paged_sets(causal_items())
    assert d == p and d_slots == p_slots
    assert p[7] == set(slots_for(list(range(5, 9)), 0, 12, BS))  # the decode row sees its 12 positions


@pytest.mark.parametrize("widths", [[], [4, 2, 1]], ids=["full", "tapered"])
def test_tree_steps_see_what_the_tree_mask_allows(widths):
    layout = tree_layout(widths)
    for step in range(3):
        n = layout.width(step)
        item = layout.step_item(step, list(range(n)))
        context, positions, mask = layout.step_inputs(step)
        expected = [{c for c, m in zip(context, mask[q].tolist()) if m} for q in range(n)]
        assert dense_sets([item])[0] == expected
        assert paged_sets([item])[0] == expected
        assert item.positions == positions
        assert dense_sets([item])[1] == paged_sets([item])[1] == [layout.scratch_slots[layout.offset(step) + q]
                                                                  for q in range(n)]


def test_a_tree_row_must_end_with_its_write_slot():
    with pytest.raises(ValueError, match="end with its own write slot"):
        TreeRows([3], [40], [3], [[41]])


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 512)] == [1, 2, 4, 8, 16, 512]
    assert bucket_for(513) is None


class ToyNet:
    """Stands in for a paged model: writes each row's id into the cache at its slot (nothing for slot -1) and
    returns features of what the row sees, so padding mistakes show in the outputs or the cache."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def __call__(self, ids, positions, cache, meta):
        k = cache.layer(0)[0]
        real = meta.slot_mapping >= 0
        k[meta.slot_mapping[real], 0, 0] = ids[real].to(k.dtype)
        seen = torch.stack([k[slots_for(meta.block_tables[g].tolist(), 0, int(p), BS), 0, 0].sum()
                            if p else torch.tensor(0.0) for g, p in zip(meta.row_group.tolist(),
                                                                         meta.prefix_len.tolist())])
        extra = torch.stack([k[meta.extra_slots[r, :int(e)], 0, 0].sum() if e else torch.tensor(0.0)
                             for r, e in enumerate(meta.extra_len.tolist())])
        return torch.stack([ids.float(), positions.float(), seen, extra], dim=1)

    def logits(self, hidden):
        return hidden * 2


def graph_runner():
    cfg = tiny_model().config
    cache = KVCache(cfg, 64, BS, torch.float32)
    # ToyNet reads its metadata on the host on purpose (readable sums), so the capture checker stays off here
    return GraphRunner(ToyNet(cache), cache, torch.device("cpu"), EagerCapture(check=False), max_table_blocks=8), cache


def replay_and_reference(runner, cache, items):
    meta = paged_metadata(items, BS)
    ids = torch.tensor([t for i in items for t in i.token_ids])
    positions = torch.tensor([p for i in items for p in i.positions])
    before = cache.data.clone()
    got = runner.replay(ids, positions, meta).clone()
    after = cache.data.clone()
    cache.data.copy_(before)
    expected = runner.net.logits(runner.net(ids, positions, cache, meta))
    assert torch.equal(cache.data, after), "the padded replay wrote other slots than the pass itself"
    return got, expected


def test_graph_replay_pads_to_its_bucket_and_reuses_its_buffers():
    runner, cache = graph_runner()
    three = causal_items()[1:]  # 1 + 5 = 6 rows: bucket 8
    got, expected = replay_and_reference(runner, cache, three)
    assert torch.equal(got, expected) and list(runner.graphs) == [(8, 0)]
    buffers = runner.graphs[(8, 0)]
    got, expected = replay_and_reference(runner, cache, causal_items()[1:2] * 1)  # 1 row: bucket 1
    assert torch.equal(got, expected)
    got, expected = replay_and_reference(runner, cache, causal_items())  # 13 rows: bucket 16
    assert torch.equal(got, expected)
    got, expected = replay_and_reference(runner, cache, [causal_items()[2]])  # 5 rows: bucket 8 again
    assert torch.equal(got, expected)
    assert runner.graphs[(8, 0)] is buffers and set(runner.graphs) == {(8, 0), (1, 0), (16, 0)}
    g = runner.graphs[(8, 0)]
    assert g.meta.slot_mapping[5:].tolist() == [-1] * 3 and g.meta.prefix_len[5:].tolist() == [0] * 3
    assert g.ids[5:].tolist() == [0] * 3  # the rows the earlier 6-row pass used are ghosts again


def test_tree_steps_get_their_own_graphs():
    runner, cache = graph_runner()
    layout = tree_layout([4, 2, 1])
    for step in range(3):
        item = layout.step_item(step, list(range(1, layout.width(step) + 1)))
        got, expected = replay_and_reference(runner, cache, [item])
        assert torch.equal(got, expected)
    assert set(runner.graphs) == {(4, 1), (2, 2), (1, 3)}  # (bucket, extra slots per row) of each step


# -- the default: the fastest exact path the device supports ------------------------------------------------

def test_defaults_take_the_fastest_exact_path():
    from saguaro import LLM
    from saguaro.backends import choose_kind
    from saguaro.backends.cpu_kernels.model import unsupported_reason
    bf16 = tiny_model(seed=3).model.to(torch.bfloat16)
    cpu_default = "cpu_kernels" if unsupported_reason(bf16) is None else "eager"
    assert choose_kind(bf16, torch.device("cpu"), enforce_eager=False) == cpu_default
    assert choose_kind(bf16, torch.device("cuda:0"), enforce_eager=False) == "paged"  # a decision only: nothing runs
    for device in ("cpu", "cuda:0"):
        assert choose_kind(bf16, torch.device(device), enforce_eager=True) == "eager"  # enforce_eager: the reference
    fp32 = tiny_model(seed=3).model
    assert choose_kind(fp32, torch.device("cpu"), enforce_eager=False) == "eager"  # fp32: no bf16 kernels
    with LLM(tiny_model(seed=3), dtype="bfloat16", block_size=4) as llm:  # LLM's own default
        assert llm.engine.target.backend.name == cpu_default
    with LLM(tiny_model(seed=3), dtype="bfloat16", block_size=4, enforce_eager=True) as llm:
        assert llm.engine.target.backend.name == "eager"


# -- the whole engine on the paged backend, on the CPU ------------------------------------------------------
# Every runner (target and drafts in this process) takes the paged backend: PagedCausalLM with the torch
# reference ops and CUDA graphs replaced by their CPU stand-in. fp32 greedy outputs must equal the eager
# reference's token for token, with batches whose passes cross bucket boundaries.

def use_paged_backend(monkeypatch):
    import saguaro.calibration.resolve as resolve
    import saguaro.engine.model_runner as model_runner
    real = model_runner.make_backend

    def paged(model, cache, device, enforce_eager, weights, head_ids, kind, graphs, **kw):
        return real(model, cache, device, enforce_eager, weights, head_ids, "paged", graphs, **kw)
    monkeypatch.setattr(model_runner, "make_backend", paged)
    # the speculator builds by graph replay, as a GPU draft does: miss strategy "auto" is jit there too
    monkeypatch.setattr(resolve, "_graph_builds", lambda cfg: not cfg.enforce_eager)


@pytest.fixture
def paged_everywhere(monkeypatch):
    use_paged_backend(monkeypatch)


ENGINE_PROMPTS = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7], [3, 3, 3, 3, 8, 40, 2, 11, 60, 1, 5], [9, 8]]


def greedy(llm, prompts):
    """Requests of different lengths, so the running batch shrinks 5, 4, 3, 2, 1 and passes cross buckets."""
    from saguaro import SamplingParams
    params = [SamplingParams(max_tokens=4 + 3 * i) for i in range(len(prompts))]
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_paged_engine_equals_the_eager_reference(arch, monkeypatch):
    from saguaro import LLM
    target = tiny_model(seed=3, layers=3, sharpness=3.0, arch=arch)
    with LLM(target, block_size=4, enforce_eager=True) as llm:
        expected = greedy(llm, ENGINE_PROMPTS)
    use_paged_backend(monkeypatch)
    with LLM(target, block_size=4) as llm:
        assert greedy(llm, ENGINE_PROMPTS) == expected
        backend, runner = llm.engine.target.backend, llm.engine.target
        assert backend.name == "paged" and backend.replays > 0
        assert {rows for rows, _ in backend.graphs.graphs} >= {1, 2, 4, 8}
        assert runner.blocks.num_free == runner.blocks.num_blocks


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_paged_speculative_modes_equal_ar(mode, paged_everywhere):
    from saguaro import LLM
    from tests.tiny import truncated
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    with LLM(target, block_size=4, enforce_eager=True) as llm:
        expected = greedy(llm, ENGINE_PROMPTS)
    options = dict(num_speculative_tokens=3, block_size=4)
    if mode == "ssd":  # the thread transport keeps the speculator, and its draft runner, in this process
        options.update(fan_out=[1, 1, 1, 2], branch_steps=2, speculator_transport="thread")
    with LLM(target=target, draft=truncated(target, 1), mode=mode, **options) as llm:
        assert greedy(llm, ENGINE_PROMPTS) == expected
        assert llm.engine.target.backend.name == "paged" and llm.engine.target.backend.replays > 0
        if mode == "ssd":
            assert llm.engine.decoder.failure is None
