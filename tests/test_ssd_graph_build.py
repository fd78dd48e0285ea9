"""The speculator's graph build (``ssd/graph_build.py``) on the paged backend's CPU stand-in.

* It captures under ``CaptureChecker`` (the stand-in runs the whole build there once), and a host read planted in
  it fails the capture (negative control).
* It gives what the Python build gives, over 50 rounds with hits, misses, admissions, releases and a preemption:
  the same cache keys, token tables and ranked ids, and the same responses, greedy and at T > 0 (both draw from
  the counter uniforms; a negative control draws the Python build's from another seed); the same probabilities
  up to the last bits (the two run their passes at other row counts, and a matrix product's rounding follows).
* Greedy SSD through it equals AR token for token (the SSD distribution tests run through it too, in
  ``test_distribution_ssd.py``).
* It reads nothing from the device, a round reads at most once when every sequence hits, and the host makes a
  constant number of torch calls per build, whatever K and the batch size (``test_ssd_graph_counts.py``).
"""
import random

import pytest
import torch

from saguaro import SamplingParams
from saguaro.backends.paged.capture_check import HostSyncError
from saguaro.engine.model_runner import ModelRunner
from saguaro.ssd import graph_build
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest
from saguaro.ssd.speculator import Speculator
from tests.test_backends import ENGINE_PROMPTS, greedy, use_paged_backend
from tests.tiny import perturbed, tiny_model, truncated

BLOCK, VOCAB, MAX_LEN = 4, 48, 64


@pytest.fixture(scope="module")
def draft():
    return perturbed(tiny_model(seed=5, vocab=VOCAB, layers=1), noise=0.05)


def paged_speculator(draft, fan_out, graph: bool, **plan) -> Speculator:
    runner = ModelRunner(draft.model, 256, BLOCK, backend="paged", max_seq_len=MAX_LEN)
    spec = Speculator.__new__(Speculator)
    spec.graph_build = graph
    spec.__init__(runner, SpecPlan.fixed(fan_out, **plan))
    assert (spec.graph is not None) == graph
    spec.counter_rng = True  # the Python build draws what the graph build would
    return spec


def cache_view(spec: Speculator) -> dict:
    """Every cached branch: its key -> its tokens, ranked ids and distributions (values, on the host)."""
    view = {}
    for key, branch in sorted(spec.cache.items()):
        ranks = spec.cache.ranks.take(branch.rank_rows)
        probs = spec.cache.probs[branch.rank_rows].tolist() if branch.sampled else None
        view[key] = (spec.cache.read_tokens(branch), ranks[0].tolist(), ranks[1].tolist(), probs)
    return view


def test_the_build_graph_captures_under_the_checker(draft, monkeypatch):
    """Negative control: a host read planted in the build fails its capture on the stand-in."""
    spec = paged_speculator(draft, [1, 2, 2], graph=True)
    spec.respond(RoundRequest([], [Admission(0, [3, 7, 1], SamplingParams(temperature=0.9), seed=4)], [], [0]))
    spec.build()
    assert len(spec.graph.graphs) == 1 and len(spec.cache) == 5  # captured (checked) and replayed
    real = graph_build._outcomes
    monkeypatch.setattr(graph_build, "_outcomes", lambda shape, f, ids, *a: real(shape, f, ids + int(ids[0, 0, 0]) * 0,
                                                                                   *a))
    spec.graph.graphs.clear()
    spec.respond(RoundRequest([Outcome(0, 0, 5)], [], [], [0]))
    with pytest.raises(HostSyncError):
        spec.build()


def sent(spec: Speculator, seq_id: int) -> list[int]:
    """The speculation under verification: on a graph build's path still on the device (read here)."""
    state = spec.states[seq_id]
    if state.spoken is None:
        return state.sent
    return spec.spoken.tokens[state.spoken.row, :state.spoken.tokens].tolist()


def _round_request(rng: random.Random, specs, live: dict, next_id: list, round_: int) -> RoundRequest:
    """Outcomes for the live sequences (a cached one most of the time, else one the cache lacks), plus
    admissions, releases and, at round 30, a preemption (a release, then the same sequence admitted again)."""
    keys = specs[0].cache.keys()
    outcomes, releases, admissions = [], [], []
    for seq_id in list(live):
        mine = [(k, t) for i, k, t in keys if i == seq_id]
        if mine and rng.random() < 0.7:
            k, t = rng.choice(mine)
        else:
            k, t = 0, next(t for t in range(VOCAB) if (0, t) not in mine and t != sent(specs[0], seq_id)[0])
        outcomes.append(Outcome(seq_id, k, t))
        live[seq_id] += sent(specs[0], seq_id)[:k] + [t]
    longest = max(live, key=lambda i: len(live[i]))
    if (round_ % 9 == 4 or len(live[longest]) > MAX_LEN - 16) and len(live) > 1:
        gone = longest if len(live[longest]) > MAX_LEN - 16 else rng.choice(sorted(live))
        releases.append(gone)
        outcomes = [o for o in outcomes if o.seq_id != gone]
        del live[gone]
    if round_ == 30:  # preempted: released now, admitted again with every token so far
        seq_id = min(live)
        releases.append(seq_id)
        outcomes = [o for o in outcomes if o.seq_id != seq_id]
        admissions.append(Admission(seq_id, live[seq_id], _params(seq_id), seed=seq_id))
    if (round_ % 7 == 1 or len(live) == 1) and len(live) < 4:
        seq_id = next_id[0]
        next_id[0] += 1
        live[seq_id] = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        admissions.append(Admission(seq_id, live[seq_id], _params(seq_id), seed=seq_id))
    return RoundRequest(outcomes, admissions, releases, sorted(live))


def _params(seq_id: int) -> SamplingParams:
    return [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_p=0.9),
            SamplingParams(temperature=0.6, top_k=5)][seq_id % 4]


def _run_pair(draft, fan_out, rounds, greedy_only, seeds=(0, 0), **plan) -> list[tuple[dict, dict]]:
    specs = [paged_speculator(draft, fan_out, graph=True, **plan), paged_speculator(draft, fan_out, graph=False,
                                                                                    **plan)]
    rng, live, next_id = random.Random(7), {}, [0]
    first = [Admission(i, [3 + i, 7, 1, 9][:2 + i], SamplingParams() if greedy_only else _params(i), seed=i)
             for i in range(2)]
    live.update({a.seq_id: list(a.tokens) for a in first})
    next_id[0] = 2
    seen = []
    for spec, offset in zip(specs, seeds):
        spec.respond(RoundRequest([], [Admission(a.seq_id, a.tokens, a.params, a.seed + offset) for a in first], [],
                                  sorted(live)))
    for round_ in range(rounds):
        views = []
        for spec in specs:
            spec.build()
            views.append(cache_view(spec))
        seen.append(tuple(views))
        request = _round_request(rng, specs, live, next_id, round_)
        if greedy_only:
            request.admissions = [Admission(a.seq_id, a.tokens, SamplingParams(), a.seed) for a in request.admissions]
        answers = []
        for spec, offset in zip(specs, seeds):
            req = RoundRequest(request.outcomes, [Admission(a.seq_id, a.tokens, a.params, a.seed + offset)
                                                  for a in request.admissions], request.releases, request.order)
            answers.append(spec.respond(req).read_tokens().rows)
        seen.append(tuple([(r.hit, r.tokens, None if r.probs is None else r.probs.tolist()) for r in rows]
                          for rows in answers))
    graph_builds = specs[0].graph.graphs
    assert graph_builds, "the graph build never ran"
    return seen


@pytest.mark.parametrize("greedy_only, fan_out, plan, rounds", [
    (True, [1, 2, 1, 2], {}, 50),
    (False, [2, 1, 1, 2], {}, 50),
    (False, [1, 2, 2], dict(branch_steps=1, deep_branches=2), 20),
], ids=["greedy", "sampled", "sampled-tapered"])
def test_the_graph_build_equals_the_python_build(draft, greedy_only, fan_out, plan, rounds):
    seen = _run_pair(draft, fan_out, rounds, greedy_only, **plan)
    hits = sum(hit for graph, _ in seen[1::2] for hit, _, _ in graph)
    misses = sum(not hit for graph, _ in seen[1::2] for hit, _, _ in graph)
    assert hits >= rounds * 0.8 and misses >= rounds * 0.4, (hits, misses)
    for n, (graph, python) in enumerate(seen):
        assert _exact(graph) == _exact(python), f"step {n}: keys, tokens or ranked ids differ"
        torch.testing.assert_close(_floats(graph), _floats(python), rtol=1e-5, atol=1e-6)


def _exact(view):
    """A round's cache view or response without its floats: keys, tokens, ranked ids, hits."""
    if isinstance(view, dict):
        return {key: (tokens, ids) for key, (tokens, ids, _, _) in view.items()}
    return [(hit, tokens) for hit, tokens, _ in view]


def _floats(view) -> torch.Tensor:
    """Its probabilities, flattened: the two builds run their passes at other row counts, so matrix products may
    round differently in the last bits (everything else is compared exactly)."""
    if isinstance(view, dict):
        values = [p for _, _, probs, dist in view.values() for p in [probs, dist] if p is not None]
    else:
        values = [probs for _, _, probs in view if probs is not None]
    return torch.cat([torch.tensor(v, dtype=torch.float64).reshape(-1) for v in values] or [torch.zeros(0)])


def test_the_comparison_sees_other_random_numbers(draft):
    """Negative control: the Python build drawing from other seeds gives other tables at T > 0."""
    seen = _run_pair(draft, [2, 1, 1, 2], 6, False, seeds=(0, 1000))
    assert any(_exact(graph) != _exact(python) for graph, python in seen)


def test_greedy_ssd_through_the_graph_build_equals_ar(monkeypatch):
    use_paged_backend(monkeypatch)
    builds = []
    real = Speculator._replay_build
    monkeypatch.setattr(Speculator, "_replay_build", lambda self, *a: builds.append(1) or real(self, *a))
    from saguaro import LLM
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    with LLM(target=target, mode="ar", block_size=4, max_num_seqs=5) as llm:
        ar = greedy(llm, ENGINE_PROMPTS)
    with LLM(target=target, mode="ssd", block_size=4, max_num_seqs=5, draft=truncated(target, 1),
             num_speculative_tokens=3, fan_out=[1, 1, 1, 2], speculator_transport="thread",
             adaptive=False) as llm:  # the graph build serves full-K speculations
        assert greedy(llm, ENGINE_PROMPTS) == ar
    assert len(builds) >= 5
