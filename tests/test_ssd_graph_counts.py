"""What the host does per round with the graph build, counted on the paged backend's CPU stand-in.

* Device reads (``tests/host_reads.py``, values followed from every pass and every build graph): a graph build
  reads nothing, and a round reads once, whether its sequences hit or miss: which branch hit for each sequence
  (looked up on the device), with the last speculations' tokens. The hits' tokens and the misses' just-in-time
  drafts go to the verifier unread (it reads them with its outcome).
* Torch calls on the host (a ``TorchFunctionMode`` counter; the graph's replay counts as one, as on a GPU it is
  one launch): at most 25 per build, and at most 60 per ``respond`` of a round whose sequences all hit (reads of
  a tensor's metadata not counted there: a response checks each row's), each the same for K = 2 and K = 5 and for
  batches of 1 and 8.
* Negative control: the Python build, counted the same way, reads the glue's ranking every build and makes more
  torch calls as K and the batch grow.
"""
import pytest

from saguaro import SamplingParams
from saguaro.sd.draft_graph import DraftStepsGraph
from saguaro.ssd.graph_build import GraphBuild
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest
from saguaro.ssd.speculator import Speculator
from tests.host_reads import TorchCalls, counting_device_reads, mark_graph_builds
from tests.test_ssd_graph_build import VOCAB, paged_speculator, sent
from tests.tiny import perturbed, tiny_model

MAX_CALLS = 25
MAX_RESPOND_CALLS = 60


@pytest.fixture(scope="module")
def draft():
    return perturbed(tiny_model(seed=5, vocab=VOCAB, layers=1), noise=0.05)


class RespondCalls(TorchCalls):
    """Torch calls, without the reads of a tensor's metadata (``shape``, ``device``: no work queued), which a
    response makes per row it checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "__get__":
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def _measure(draft, monkeypatch, k: int, batch: int, graph: bool, rounds: int = 3, greedy: bool = False,
             jit_graph: bool = True) -> dict:
    """Torch calls and device reads of each build, reads of each round (respond + build) and torch calls of each
    round's respond, after a warm-up round (the build graph is captured there, at start-up on a GPU). ``greedy``:
    every sequence greedy (else sampled, then mixed), so that a miss drafts in the just-in-time steps graph unless
    ``jit_graph`` is off."""
    spec = paged_speculator(draft, [1] * k + [2], graph=graph)
    if not jit_graph:
        spec.jit.steps_graph = None
    calls, respond_calls = TorchCalls(), RespondCalls()
    if graph:
        real, real_steps = GraphBuild._graph, DraftStepsGraph._graph

        def counted_graph(self, shape):
            host, staged, replay, out = real(self, shape)
            return host, staged, calls.replayed(replay), out

        def counted_steps(self, shape):  # replayed in a respond
            host, staged, feed, replay, out = real_steps(self, shape)
            return host, staged, feed, respond_calls.replayed(replay), out
        monkeypatch.setattr(GraphBuild, "_graph", counted_graph)
        monkeypatch.setattr(DraftStepsGraph, "_graph", counted_steps)
        spec.capture_builds(batch)  # as at start-up: no round captures
    mark_graph_builds(monkeypatch)
    params = [SamplingParams(temperature=0.0 if greedy else 0.8 * ((i + 1) % 2)) for i in range(batch)]
    order = list(range(batch))
    spec.respond(RoundRequest([], [Admission(i, [3, 7, 1 + i], p, seed=i) for i, p in enumerate(params)], [], order))
    spec.build()
    seen = {"calls": [], "respond_calls": [], "miss_respond_calls": [], "build_reads": [], "hit_round_reads": [],
            "miss_round_reads": []}
    with counting_device_reads(monkeypatch) as reads:
        for round_ in range(2 * rounds):
            miss = round_ % 2 == 1
            outcomes = [Outcome(i, *_key(spec, i)) if not miss else Outcome(i, 0, _unprepared(spec, i))
                        for i in order]  # the test's own reads, before the round's
            before = reads.count
            with respond_calls:
                respond_calls.count = 0
                spec.respond(RoundRequest(outcomes, [], [], order))
            seen["miss_respond_calls" if miss else "respond_calls"].append(respond_calls.count)
            at_build = reads.count
            with calls:
                calls.count = 0
                spec.build()
            seen["calls"].append(calls.count)
            seen["build_reads"].append(reads.count - at_build)
            seen["miss_round_reads" if miss else "hit_round_reads"].append(reads.count - before)
    assert spec.last_build.steps == k
    return seen


def _key(spec: Speculator, seq_id: int) -> tuple[int, int]:
    """The first outcome the cache prepared for ``seq_id``."""
    return next((kk, t) for i, kk, t in spec.cache.keys() if i == seq_id)


def _unprepared(spec: Speculator, seq_id: int) -> int:
    """A bonus token at depth 0 that the cache did not prepare for (nor the drafted token)."""
    taken = {t for i, kk, t in spec.cache.keys() if i == seq_id and kk == 0}
    return next(t for t in range(VOCAB) if t not in taken and t != sent(spec, seq_id)[0])


def test_a_graph_build_reads_nothing_and_a_round_reads_once(draft, monkeypatch):
    calls, respond_calls = {}, {}
    for k, batch in [(2, 1), (5, 1), (2, 8), (5, 8)]:
        seen = _measure(draft, monkeypatch, k, batch, graph=True, rounds=2)
        assert seen["build_reads"] == [0] * len(seen["build_reads"]), (k, batch)
        assert seen["hit_round_reads"] == [1] * len(seen["hit_round_reads"]), (k, batch)
        assert seen["miss_round_reads"] == [1] * len(seen["miss_round_reads"]), (k, batch)
        calls[(k, batch)], respond_calls[(k, batch)] = seen["calls"], seen["respond_calls"]
    assert len({c for counts in calls.values() for c in counts}) == 1, calls  # every build, every K and batch
    assert len({c for counts in respond_calls.values() for c in counts}) == 1, respond_calls
    assert calls[(2, 1)][0] <= MAX_CALLS, calls
    assert respond_calls[(2, 1)][0] <= MAX_RESPOND_CALLS, respond_calls
    print(f"torch calls per graph build: {calls[(2, 1)][0]}, per respond of a hit round: {respond_calls[(2, 1)][0]}")


def test_a_miss_round_drafts_in_one_graph_and_reads_once(draft, monkeypatch):
    """Greedy misses draft just in time in one replay of K steps: a miss round reads once and its ``respond`` makes
    the same few torch calls for any K and batch. Negative control: drafting step by step, the counter sees the
    calls grow with K."""
    calls = {}
    for k, batch in [(2, 1), (5, 1), (2, 8), (5, 8)]:
        seen = _measure(draft, monkeypatch, k, batch, graph=True, rounds=2, greedy=True)
        assert seen["miss_round_reads"] == [1] * len(seen["miss_round_reads"]), (k, batch)
        calls[(k, batch)] = seen["miss_respond_calls"]
    assert len({c for counts in calls.values() for c in counts}) == 1, calls
    assert calls[(2, 1)][0] <= MAX_RESPOND_CALLS, calls
    stepped = {k: _measure(draft, monkeypatch, k, 1, graph=True, rounds=1, greedy=True, jit_graph=False)
               for k in (2, 5)}
    assert stepped[5]["miss_respond_calls"][0] > stepped[2]["miss_respond_calls"][0] > calls[(2, 1)][0], stepped
    print(f"torch calls per respond of a miss round: {calls[(2, 1)][0]}")


def test_the_counters_see_the_python_builds_reads_and_calls(draft, monkeypatch):
    """Negative control: the Python build reads the glue's ranking each build, and calls torch more as K and the
    batch grow."""
    small = _measure(draft, monkeypatch, 2, 1, graph=False, rounds=1)
    large = _measure(draft, monkeypatch, 5, 8, graph=False, rounds=1)
    assert min(small["build_reads"]) >= 1
    assert min(large["calls"]) > max(small["calls"]) > MAX_CALLS
