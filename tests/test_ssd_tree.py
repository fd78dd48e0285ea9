"""The speculation tree: outcome guesses ordered by the draft's own likelihood, and tapered builds.

A tapered build decodes every branch for ``branch_steps`` steps and only the likeliest
``deep_branches`` after that, up to K. Whatever the widths, each branch must hold exactly what
the draft would draft alone after the verified prefix, the glued speculation up to its fork and
its root token (greedy, fp32), so the tree mask and the step-major scratch layout are checked
against plain sequential decoding.
"""
import pytest
import torch

from saguaro import SamplingParams
from saguaro.engine.model_runner import ModelRunner
from saguaro.sampling.ranked import Ranked, rank_positions
from saguaro.ssd.outcomes import predict_outcomes
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import Admission, RoundRequest
from saguaro.ssd.speculator import Speculator
from saguaro.ssd.tree import BranchLayout
from tests.tiny import greedy_tokens, perturbed, tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def draft():
    return perturbed(tiny_model(seed=5, vocab=48, layers=2), noise=0.05)


def test_rank_positions_gives_softmax_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    (top,) = rank_positions(logits, 3)
    assert top.ids == [1, 2, 0]
    torch.testing.assert_close(torch.tensor(top.probs), torch.softmax(logits[0], -1)[[1, 2, 0]])
    assert top.prob(3) == 0.0  # not ranked


def test_outcomes_come_likeliest_first():
    # depth 0: drafted 5 with q 0.9; depth 1: drafted 6 with q 0.5; depth 2 (all accepted)
    ranked = [Ranked([5, 1, 2], [0.9, 0.06, 0.04]), Ranked([6, 3, 4], [0.5, 0.3, 0.2]), Ranked([7, 8], [0.8, 0.2])]
    outcomes = predict_outcomes(ranked, [5, 6], [2, 2, 2])
    # scores: (0,1) .06 (0,2) .04 (1,3) .27 (1,4) .18 (2,7) .36 (2,8) .09
    assert outcomes == [(2, 7), (1, 3), (1, 4), (2, 8), (0, 1), (0, 2)]
    assert sorted(outcomes) == sorted(predict_outcomes(ranked, [5, 6], [2, 2, 2]))
    assert (0, 5) not in outcomes and (1, 6) not in outcomes  # a drafted token is never its depth's bonus


def test_branch_widths_and_layout_checks():
    plan = SpecPlan.fixed([1, 1, 1, 1, 2], branch_steps=2, deep_branches=2)
    assert plan.branch_widths(6) == [6, 6, 2, 2]
    assert plan.branch_widths(1) == [1, 1, 1, 1]
    assert SpecPlan.fixed([1, 1, 2]).branch_widths(4) == [4, 4]
    with pytest.raises(ValueError, match="branch_steps"):
        SpecPlan.fixed([1, 1, 2], branch_steps=3)
    with pytest.raises(ValueError, match="deep_branches"):
        SpecPlan.fixed([1, 1, 2], branch_steps=1, deep_branches=0)
    with pytest.raises(ValueError, match="non-increasing"):
        BranchLayout([0, 1], 2, [0, 1], [3, 4], [1, 2])
    lay = BranchLayout([0, 1], 2, [0, 1, 2], [3, 4, 5], [3, 1, 1])
    assert [lay.offset(j) for j in range(4)] == [0, 3, 4, 5] and lay.scratch_size(3) == 5


@pytest.mark.parametrize("branch_steps, deep", [(None, 1), (2, 2), (1, 1)])
def test_every_branch_equals_sequential_drafting(draft, branch_steps, deep):
    k, fan_out = 4, [2, 1, 1, 1, 3]
    plan = SpecPlan.fixed(fan_out, branch_steps=branch_steps, deep_branches=deep)
    spec = Speculator(ModelRunner(draft.model, 256, BLOCK), plan)
    prompt = [3, 7, 1, 9, 4, 11]
    spec.respond(RoundRequest([], [Admission(0, prompt, SamplingParams(max_tokens=64), seed=0)], [], [0]))
    spec.build()
    sent = spec.states[0].sent
    entries = {(kk, t): spec.cache.read_tokens(c) for (i, kk, t), c in spec.cache.items() if i == 0}
    assert len(entries) == sum(fan_out)
    lengths = sorted((len(toks) for toks in entries.values()), reverse=True)
    n, long = len(entries), len(entries) if branch_steps is None else deep
    assert lengths == [k] * long + [branch_steps or k] * (n - long)
    for (i, kk, t), cached in spec.cache.items():
        if i != 0:
            continue
        tokens = entries[(kk, t)]
        context = prompt + sent[:kk] + [t]
        assert tokens == greedy_tokens(draft, [context], len(tokens))[0], (kk, t)
        assert len(cached.kv_slots) == len(spec.cache.ranks.rows(cached.rank_rows)) == cached.length == len(tokens)
        assert spec.cache.tokens[cached.row, cached.length:].eq(-1).all()  # the table's padding
    spec.close()
    assert spec.runner.blocks.num_free == spec.runner.blocks.num_blocks
