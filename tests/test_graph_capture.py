"""CUDA-graph capture, checked on the CPU: what a capture forbids, when captures happen, how a replay is staged.

* ``CaptureChecker`` raises on every host sync and data-dependent shape a capture cannot hold, and lets
  capturable ops through; the paged backend's torch reference runs AR, SD and SSD passes under it (the
  stand-in ``EagerCapture`` checks every graph it "captures"), and a ``.item()`` planted in the forward fails.
* Captures happen at start-up, one at a time: the target's before the speculator thread's, both before the
  first round; a pass with no graph after start-up runs eagerly, counted, and gives the same logits.
* A replay's per-row fields pack into one staging buffer and unpack into the graph's buffers exactly.
* A CUDA replay keeps alive what its recorded function closes over (CUDA faked).
"""
import threading

import pytest
import torch

from saguaro.backends.batch import ForwardItem
from saguaro.backends.paged import graphs as graphs_module
from saguaro.backends.paged.backend import PagedBackend
from saguaro.backends.paged.capture_check import CaptureChecker, HostSyncError, capturing
from saguaro.backends.paged.graphs import EagerCapture, GraphRunner
from saguaro.backends.paged.metadata import build_paged_metadata, paged_metadata
from saguaro.backends.paged.model import PagedCausalLM, ops_for
from saguaro.backends.paged.staging import StagingLayout
from saguaro.kv.kv_cache import KVCache
from tests.test_backends import ENGINE_PROMPTS, greedy, use_paged_backend
from tests.tiny import tiny_model, truncated

T = torch.tensor([3, 0, 2])

FORBIDDEN = {
    "item": lambda: T.sum().item(),
    "tolist": lambda: T.tolist(),
    "cpu": lambda: T.cpu(),
    "to cpu": lambda: T.to("cpu"),
    "int()": lambda: int(T.max()),
    "if tensor": lambda: bool(T.any()),
    "nonzero": lambda: T.nonzero(),
    "where(cond)": lambda: torch.where(T > 0),
    "boolean mask": lambda: T[T > 0],
    "boolean mask write": lambda: T.clone().__setitem__(T > 0, 1),
    "masked_select": lambda: T.masked_select(T > 0),
    "unique": lambda: T.unique(),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.arange(3), T),
    "equal": lambda: torch.equal(T, T),
}
ALLOWED = {
    "where": lambda: torch.where(T > 0, T, 0),
    "long index": lambda: T[torch.tensor([2, 0])],
    "argmax": lambda: (T > 0).to(torch.int8).argmax(),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(torch.arange(3), T, output_size=5),
    "masked_fill": lambda: T.masked_fill(T > 0, 7),
    "dtype": lambda: T.to(torch.float32),
}


@pytest.mark.parametrize("name", list(FORBIDDEN))
def test_the_checker_refuses_host_syncs_and_data_dependent_shapes(name):
    with CaptureChecker(), pytest.raises(HostSyncError):
        FORBIDDEN[name]()
    FORBIDDEN[name]()  # fine outside a capture


@pytest.mark.parametrize("name", ["item", "int()", "if tensor"])
def test_the_checker_refuses_host_reads_under_inference_mode(name):
    with torch.inference_mode(), CaptureChecker(), pytest.raises(HostSyncError):
        FORBIDDEN[name]()


@pytest.mark.parametrize("name", list(ALLOWED))
def test_the_checker_lets_capturable_ops_through(name):
    with CaptureChecker():
        assert capturing()
        ALLOWED[name]()
    assert not capturing()


def test_the_checker_is_per_thread():
    seen = []
    with CaptureChecker():
        worker = threading.Thread(target=lambda: seen.append((capturing(), T.tolist())))
        worker.start()
        worker.join()
    assert seen == [(False, [3, 0, 2])]


# -- the paged backend under the checker --------------------------------------------------------------------

def _paged_runner(cache_blocks=32, block_size=4, max_table_blocks=8):
    model = tiny_model(seed=3, layers=2)
    cache = KVCache(model.config, cache_blocks, block_size, torch.float32)
    net = PagedCausalLM(model.model, ops_for(torch.device("cpu")))
    return net, cache, GraphRunner(net, cache, torch.device("cpu"), EagerCapture(), max_table_blocks)


def test_a_planted_host_read_in_the_forward_fails_the_capture(monkeypatch):
    """Negative control: the same capture that passes below fails once the forward reads a value on the host."""
    net, cache, runner = _paged_runner()
    runner.capture_all(max_rows=2)  # the real forward passes
    real = PagedCausalLM.forward
    monkeypatch.setattr(PagedCausalLM, "forward",
                        lambda self, ids, *a: real(self, ids + int(ids.sum().item()) * 0, *a))
    with pytest.raises(HostSyncError, match="item"):
        _paged_runner()[2].capture_all(max_rows=2)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_captures_happen_at_start_up_one_at_a_time(mode, monkeypatch):
    """Every graph of the target (and of the SD draft, or the SSD speculator thread's draft) is captured, under
    the checker, while the LLM starts: the target's first, each under the capture lock, none once rounds run,
    and every pass that fits a bucket finds its graph (the reachable buckets were all captured)."""
    use_paged_backend(monkeypatch)
    events = []
    real_capture_all, real_make, real_replay = GraphRunner.capture_all, GraphRunner._make, GraphRunner.replay

    def capture_all(self, *a, **kw):
        events.append(("capture", threading.current_thread().name))
        return real_capture_all(self, *a, **kw)

    def make(self, rows, extras):
        assert graphs_module.CAPTURE_LOCK.locked()
        return real_make(self, rows, extras)

    def replay(self, *a):
        out = real_replay(self, *a)
        events.append(("replay" if out is not None else "uncaptured", threading.current_thread().name))
        return out
    monkeypatch.setattr(GraphRunner, "capture_all", capture_all)
    monkeypatch.setattr(GraphRunner, "_make", make)
    monkeypatch.setattr(GraphRunner, "replay", replay)
    from saguaro import LLM
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    options = {} if mode == "ar" else dict(draft=truncated(target, 1), num_speculative_tokens=3)
    if mode == "ssd":
        options.update(fan_out=[1, 1, 1, 2], speculator_transport="thread")
    with LLM(target=target, mode=mode, block_size=4, max_num_seqs=5, **options) as llm:
        started = len(events)
        greedy(llm, ENGINE_PROMPTS)
        graphs = llm.engine.target.backend.graphs
        assert graphs.sealed and graphs.uncaptured == 0 and llm.engine.target.backend.replays > 0
    captures = events[:started]
    assert captures and all(kind == "capture" for kind, _ in captures)
    assert captures[0][1] == threading.main_thread().name  # the target first
    if mode == "ssd":
        assert captures[-1][1] == "saguaro-speculator"  # then the speculator, before its ready reply
    # no capture once rounds run, and every pass of every runner (the speculator's too) found its graph
    assert all(kind == "replay" for kind, _ in events[started:])


def test_a_pass_without_a_graph_after_start_up_runs_eagerly_and_is_counted():
    net, cache, runner = _paged_runner()
    runner.capture_all(max_rows=4, extras=(0,))
    backend = PagedBackend(net, torch.device("cpu"), runner)
    item = ForwardItem([5, 6, 7], 0, [0, 1], logits="all")
    meta = paged_metadata([item], cache.block_size)
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    replayed = backend.run(ids, positions, meta, cache, torch.arange(3)).clone()
    assert backend.replays == 1 and runner.uncaptured == 0
    tree_meta = build_paged_metadata([[0, 1]], [0, 0], [3, 3], [9, 10], [[9], [10]], cache.block_size)  # E = 1
    backend.run(torch.tensor([1, 2]), torch.tensor([3, 3]), tree_meta, cache, torch.arange(2))
    assert runner.uncaptured == 1 and backend.eager_passes == 1 and (2, 1) not in runner.graphs
    eager = PagedBackend(net, torch.device("cpu"), None).run(ids, positions, meta, cache, torch.arange(3))
    torch.testing.assert_close(replayed, eager)


# -- staging ------------------------------------------------------------------------------------------------

def test_staging_packs_a_pass_and_unpacks_it_padded_with_ghosts():
    layout = StagingLayout(rows=4, extras=2, table_width=3)
    meta = build_paged_metadata([[7, 8], [9]], [0, 0, 1], [5, 6, 2], [29, 30, 37], [[29], [30, 31], [37]], 4)
    host = torch.full((layout.size,), 99, dtype=torch.int64)
    used = layout.pack(host, torch.tensor([11, 12, 13]), torch.tensor([4, 5, 1]), meta)
    assert used == layout.table_offset + 2 * 3  # the block tables of the pass's two groups, not all four rows
    assert layout.row_field(host, "ids").tolist() == [11, 12, 13, 0]
    staged = host.clone()
    positions = torch.zeros(4, dtype=torch.int64)
    out = build_paged_metadata([[0, 0, 0]] * 4, [0] * 4, [0] * 4, [0] * 4, [[0, 0]] * 4, 4)
    layout.unpack(staged, positions, out)
    assert positions.tolist() == [4, 5, 1, 0]
    assert out.slot_mapping.tolist() == [29, 30, 37, -1] and out.row_group.tolist() == [0, 0, 1, 0]
    assert out.prefix_len.tolist() == [5, 6, 2, 0] and out.extra_len.tolist() == [1, 2, 1, 0]
    assert out.extra_slots[:3].tolist() == [[29, 0], [30, 31], [37, 0]]
    assert out.block_tables[:2, :2].tolist() == [[7, 8], [9, 0]]
    assert out.row_group.dtype == torch.int32 and out.block_tables.dtype == torch.int32
    with pytest.raises(ValueError, match="does not fit"):
        StagingLayout(rows=2, extras=2, table_width=3).pack(host, None, torch.zeros(3), meta)


def test_a_cuda_replay_keeps_alive_what_its_function_closes_over(monkeypatch):
    """``CudaCapture``'s replay holds the recorded function, so a tensor made for one capture alone (the build
    graph's fork depths) lives as long as the graph: freed, the allocator would hand its memory out again and the
    replay would read whatever came to lie there (on an H200 every cache key read depth 0). CUDA faked, on the
    CPU; the negative control: once the replay is dropped, the tensor is freed."""
    import contextlib
    import gc
    import weakref

    class FakeGraph:
        replays = 0

        def replay(self):
            FakeGraph.replays += 1

    class FakeStream:
        def wait_stream(self, other):
            pass
    for name, fake in (("graph_pool_handle", lambda: None), ("Stream", lambda device: FakeStream()),
                       ("current_stream", lambda *a: FakeStream()), ("stream", lambda s: contextlib.nullcontext()),
                       ("CUDAGraph", FakeGraph), ("graph", lambda *a, **kw: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, fake)
    capture = graphs_module.CudaCapture(torch.device("cpu"))

    def capture_with_an_input_of_its_own():
        depths = torch.arange(4)
        replay, _ = capture(lambda: depths * 2)
        return replay, weakref.ref(depths)
    replay, depths = capture_with_an_input_of_its_own()
    gc.collect()
    assert depths() is not None, "the captured function's input was freed while its graph lives"
    replay()
    assert FakeGraph.replays == 1
    del replay
    gc.collect()
    assert depths() is None  # what held it was the replay
