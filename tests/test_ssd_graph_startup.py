"""The speculator's build graphs are captured at start-up, on the paged backend's CPU stand-in: every shape a
round can take (``graph_staging.startup_shapes``), so that no round captures (on a GPU a capture would run beside
the target's verification, and synchronize the device under it).

* Through the engine (a speculator thread): greedy, sampled and top-k/top-p requests in batches that shrink from
  5 to 1 replay build graphs, and none is captured after start-up.
* On a speculator alone: 40 rounds of mixed requests, admissions, releases and a preemption capture nothing new.
* Negative control: without the start-up capture the same rounds do capture.
* With adaptation the plan offers several cache trees: each is captured at start-up, a round in any of them
  replays its graph, and greedy outputs equal AR's.
"""
import random

import pytest

from saguaro import SamplingParams
from saguaro.adapt_settings import TREE_OPTIONS, AdaptSettings
from saguaro.ssd.graph_build import GraphBuild
from saguaro.ssd.protocol import Admission, RoundRequest
from tests.test_backends import ENGINE_PROMPTS, use_paged_backend
from tests.test_ssd_graph_build import VOCAB, _round_request, paged_speculator
from tests.test_adapt_trees_exact import CyclingTrees
from tests.tiny import greedy_tokens, perturbed, tiny_model, truncated


@pytest.fixture
def captures(monkeypatch):
    """Every build graph captured, in order."""
    made = []
    real = GraphBuild._make

    def make(self, shape):
        made.append(shape)
        return real(self, shape)
    monkeypatch.setattr(GraphBuild, "_make", make)
    return made


@pytest.fixture
def replayed(monkeypatch):
    """Every build graph replayed, by its shape, in order."""
    shapes = []
    real = GraphBuild.run
    monkeypatch.setattr(GraphBuild, "run", lambda self, shape, *a: shapes.append(shape) or real(self, shape, *a))
    return shapes


def test_the_engine_captures_no_build_graph_after_start_up(monkeypatch, captures, replayed):
    use_paged_backend(monkeypatch)
    from saguaro import LLM
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    with LLM(target=target, mode="ssd", block_size=4, max_num_seqs=5, draft=truncated(target, 1),
             num_speculative_tokens=3, fan_out=[1, 1, 1, 2], speculator_transport="thread", adaptive=False) as llm:
        at_start = list(captures)
        kinds = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.1, top_k=5, top_p=0.9)]
        for params in kinds:
            llm.generate(ENGINE_PROMPTS, [SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                         top_p=params.top_p, max_tokens=4 + 3 * i, seed=i)
                                          for i in range(len(ENGINE_PROMPTS))])
    assert at_start and captures == at_start, "a build graph was captured after start-up"
    assert {s.seqs for s in replayed} >= {1, 2, 4, 8} and {(s.sampled, s.filters) for s in replayed} == {
        (False, False), (True, False), (True, True)}


def test_every_cache_tree_is_captured_at_start_up_and_replayed(monkeypatch, captures, replayed):
    use_paged_backend(monkeypatch)
    from saguaro import LLM
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    expected = greedy_tokens(target, ENGINE_PROMPTS, 10)
    with LLM(target=target, mode="ssd", block_size=4, max_num_seqs=5, draft=truncated(target, 1),
             num_speculative_tokens=3, fan_out=[1, 1, 1, 2], speculator_transport="thread",
             adapt=AdaptSettings(trees_without_profile=True, **TREE_OPTIONS)) as llm:  # no profile: trees asked for
        at_start = list(captures)
        trees = llm.engine.decoder.plan.trees
        llm.engine.decoder.schedule = CyclingTrees(3, [3], trees)
        outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=10))
    assert trees > 3 and at_start and captures == at_start, "a build graph was captured after start-up"
    assert len({(s.counts, s.widths) for s in replayed}) >= trees - 1  # the trees' shapes (two may coincide)
    assert [o.token_ids for o in outs] == expected


def _rounds(spec, n: int) -> None:
    """``n`` rounds of greedy and sampled sequences (``test_ssd_graph_build``'s mix) on one speculator."""
    rng, live = random.Random(3), {0: [3, 7], 1: [4, 7, 1]}
    spec.respond(RoundRequest([], [Admission(i, t, SamplingParams(temperature=0.8 * i), seed=i)
                                   for i, t in live.items()], [], sorted(live)))
    next_id = [2]
    for round_ in range(n):
        spec.build()
        spec.respond(_round_request(rng, [spec], live, next_id, round_))


@pytest.mark.parametrize("fan_out, plan", [([1, 2, 1, 2], {}), ([1, 2, 2], dict(branch_steps=1, deep_branches=2))],
                         ids=["full", "tapered"])
def test_a_speculator_captured_at_start_up_captures_nothing_later(captures, fan_out, plan):
    draft = perturbed(tiny_model(seed=5, vocab=VOCAB, layers=1), noise=0.05)
    spec = paged_speculator(draft, fan_out, graph=True, **plan)
    spec.capture_builds(4)
    at_start = list(captures)
    assert spec.graph.started and len(at_start) == len(set(at_start))
    _rounds(spec, 40)
    assert captures == at_start and len(spec.graph.graphs) == len(at_start)

    control = paged_speculator(draft, fan_out, graph=True, **plan)  # negative control: captured on first use
    captures.clear()
    _rounds(control, 40)
    assert captures and set(captures) <= set(at_start)
