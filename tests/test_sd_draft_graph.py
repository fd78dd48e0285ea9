"""SD's draft steps 2..K as one captured graph (``sd/draft_graph.py``), on the paged backend's CPU stand-in.

* Greedy SD through it equals AR token for token, and its proposals equal the step-by-step ones (tokens and
  probabilities) over rounds with commits.
* It captures under ``CaptureChecker``; a host read planted in it fails the capture (negative control).
* The host's torch calls per greedy round are the same for K = 2 and K = 5 (the replay counts as one call, as on a
  GPU it is one launch); step by step they grow with K (negative control).
"""
import pytest
import torch

from saguaro import SamplingParams
from saguaro.backends.paged.capture_check import HostSyncError
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.sequence import Sequence
from saguaro.sd import draft_graph
from saguaro.sd.draft_model import DraftModelProposer
from benchmarks.build_counters import TorchCalls
from tests.test_backends import ENGINE_PROMPTS, greedy, use_paged_backend
from tests.tiny import tiny_model, truncated

BLOCK = 4


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=5, layers=2, sharpness=3.0)


def _proposer(draft, graph: bool, keep_ranked: int = 0, row_graphs: bool = True) -> DraftModelProposer:
    proposer = DraftModelProposer(ModelRunner(draft.model, 128, BLOCK, backend="paged", max_seq_len=64,
                                              graphs=row_graphs), keep_ranked=keep_ranked)
    assert (proposer.steps_graph is not None) == row_graphs
    if not graph:
        proposer.steps_graph = None
    return proposer


def _seqs(prompts):
    return [Sequence(list(p), SamplingParams()) for p in prompts]


def test_greedy_sd_through_the_steps_graph_equals_ar(monkeypatch):
    use_paged_backend(monkeypatch)
    replays = []
    real = draft_graph.DraftStepsGraph.run
    monkeypatch.setattr(draft_graph.DraftStepsGraph, "run", lambda self, *a: replays.append(1) or real(self, *a))
    from saguaro import LLM
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    with LLM(target=target, mode="ar", block_size=4, max_num_seqs=5) as llm:
        ar = greedy(llm, ENGINE_PROMPTS)
    with LLM(target=target, mode="sd", block_size=4, max_num_seqs=5, draft=truncated(target, 1),
             num_speculative_tokens=3, adaptive=False) as llm:
        graphs = llm.engine.decoder.proposer.steps_graph.graphs
        at_start = set(graphs)  # captured at start-up: buckets 1..8, K = 2 and 3
        assert {(s.seqs, s.steps) for s in at_start} == {(b, k) for b in (1, 2, 4, 8) for k in (1, 2)}
        assert greedy(llm, ENGINE_PROMPTS) == ar
        assert set(graphs) == at_start  # none captured while serving
    assert len(replays) >= 3  # the rounds whose sequences all draft K (budgets shorten the others)


def test_the_steps_graph_proposes_what_the_steps_propose(draft):
    proposers = [_proposer(draft, True), _proposer(draft, False)]
    seqs = [_seqs(ENGINE_PROMPTS[:3]) for _ in proposers]
    _rounds(proposers, seqs, 5)
    assert len(proposers[0].steps_graph.graphs) == 1


def _rounds(proposers, seqs, accept_mod: int, check=lambda out, round_: None) -> None:
    """Six rounds of K = 4 through both proposers, each checked to propose the same: sequence b accepts a prefix
    (b + round) % ``accept_mod`` long, then the target's token."""
    for p, s in zip(proposers, seqs):
        p.prefill(s)
    for round_ in range(6):
        out = [p.propose(s, [4] * len(s)) for p, s in zip(proposers, seqs)]
        assert out[0].tokens == out[1].tokens, round_
        assert torch.equal(out[0].probs, out[1].probs), round_
        check(out, round_)
        for p, s in zip(proposers, seqs):
            for b, seq in enumerate(s):
                accepted = (b + round_) % accept_mod
                seq.output_ids += out[0].tokens[b][:accepted] + [(round_ * 7 + b) % 50]
                p.commit(seq, 4, accepted)


def test_the_k_step_graph_drafts_and_ranks_what_the_steps_do(draft):
    """SSD's just-in-time drafts (ranked ids kept): where every draft cache lacks only the last token, all K steps
    run as one replay (``StepsShape.first``); tokens, probabilities and ranked ids equal the step-by-step ones. Rounds
    accept fewer than K drafts: one that accepts all K leaves two tokens to feed, and runs step by step."""
    proposers = [_proposer(draft, True, keep_ranked=4), _proposer(draft, False, keep_ranked=4)]
    replays = []
    real = proposers[0].steps_graph.run
    proposers[0].steps_graph.run = lambda *a: replays.append(1) or real(*a)
    seqs = [_seqs(ENGINE_PROMPTS[:3]) for _ in proposers]

    def same_ranks(out, round_):
        ranks = [[p.rank_table.rows(rows) for rows in p.rank_rows] for p in out]
        assert [[r.ids for r in rows] for rows in ranks[0]] == [[r.ids for r in rows] for rows in ranks[1]], round_
        torch.testing.assert_close(*[torch.tensor([[r.probs for r in rows] for rows in side]) for side in ranks],
                                   rtol=1e-4, atol=1e-5)  # passes of other row counts round their last bits apart
    _rounds(proposers, seqs, 4, same_ranks)
    assert len(replays) == 6
    shapes = set(proposers[0].steps_graph.graphs)
    assert shapes and all(shape.first and shape.steps == 4 and shape.ranked == 4 for shape in shapes)


def test_the_steps_graph_captures_under_the_checker(draft, monkeypatch):
    proposer = _proposer(draft, True)
    seqs = _seqs([[3, 7, 1, 9]])
    proposer.prefill(seqs)
    proposer.propose(seqs, [3])
    assert len(proposer.steps_graph.graphs) == 1  # captured (checked) and replayed
    proposer.commit(seqs[0], 3, 1)
    seqs[0].output_ids += [5, 6]
    net = proposer.steps_graph.net
    monkeypatch.setattr(proposer.steps_graph, "net", lambda ids, *a: net(ids + int(ids[0]) * 0, *a))
    proposer.steps_graph.net.logits = net.logits
    proposer.steps_graph.graphs.clear()
    with pytest.raises(HostSyncError):
        proposer.propose(seqs, [3])


def _calls(draft, monkeypatch, k: int, graph: bool) -> int:
    proposer = _proposer(draft, graph)
    calls = TorchCalls()
    if graph:
        real = draft_graph.DraftStepsGraph._graph

        def counted(self, shape):
            host, staged, feed, replay, out = real(self, shape)
            return host, staged, feed, calls.replayed(replay), out
        monkeypatch.setattr(draft_graph.DraftStepsGraph, "_graph", counted)
    seqs = _seqs([[3, 7, 1, 9], [5, 2]])
    proposer.prefill(seqs)
    proposer.propose(seqs, [k, k])  # the capture
    for seq in seqs:
        proposer.commit(seq, k, 0)
        seq.output_ids.append(11)
    with calls:
        proposer.propose(seqs, [k, k])
    return calls.count


def test_host_torch_calls_per_round_do_not_grow_with_k(draft, monkeypatch):
    graphed = {k: _calls(draft, monkeypatch, k, True) for k in (2, 5)}
    assert graphed[2] == graphed[5], graphed
    stepped = {k: _calls(draft, monkeypatch, k, False) for k in (2, 5)}
    assert stepped[5] > stepped[2] and stepped[5] > graphed[5], (stepped, graphed)


def test_a_row_graph_captured_beside_a_cached_sequence_leaves_its_cache_alone(draft):
    """A row graph captured after a sequence's prefill (the runner captures on first use) drafts what a runner
    without graphs drafts: the capture's run stages ghost rows, slot -1. Negative control: staged zeros meant
    slot 0, the first sequence's first cache slot, and the drafts changed ([24, 16, 48, 46] for these)."""
    drafted = []
    for row_graphs in (True, False):
        proposer = _proposer(draft, False, row_graphs=row_graphs)
        seqs = _seqs([[3, 7, 1], [3, 7, 1]])
        proposer.prefill(seqs)
        drafted.append(proposer.propose(seqs, [4, 4]).tokens)
    assert drafted[0] == drafted[1] and drafted[0][0] == drafted[0][1]
