"""The decode loop of a request that asks for no option (greedy, no penalties, no logprobs, no grammar) runs none
of the options' code, and the greedy shortcuts it takes give exactly what the general passes give.

The shortcuts: ``probs_from_logits`` of an all-greedy batch returns the one-hots without the filters, and
``rejection_sample_tensors`` of an all-greedy batch tests the drafts against the argmax without drawing or
normalizing. Each is checked against the general pass (a batch with one sampled row takes it), on logits with
ties, and a run of every mode is checked to enter none of the options' or the sampled path's functions.
"""
from __future__ import annotations

import sys

import pytest
import torch

import saguaro.sampling.logit_processors as processors_module
import saguaro.sampling.logprobs as logprobs_module
import saguaro.sampling.sampler as sampler_module
import saguaro.verify.rejection as rejection_module
from saguaro import SamplingParams
from saguaro.sampling.grammar import GrammarState
from saguaro.calibration.timeline import RowCurve, rows_time
from saguaro.adapt.costs import LiveCosts
from saguaro.sampling.processors import probs_from_logits
from saguaro.verify import rejection_sample_tensors
from tests.tiny import PROMPTS, every_mode, greedy_tokens, tiny_model, truncated

VOCAB = 40


def _tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits rounded to a coarse grid, so that rows hold ties at their maximum (argmax: the lowest index)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 2).round()


def test_all_greedy_probs_equal_the_general_pass():
    logits = _tied_logits(12, seed=0)
    assert any(int((row == row.max()).sum()) > 1 for row in logits)  # ties present
    n = logits.shape[0]
    greedy = probs_from_logits(logits, torch.zeros(n), torch.full((n,), 5), torch.full((n,), 0.9))
    mixed_t = torch.zeros(n + 1)
    mixed_t[-1] = 0.7  # one sampled row: the general pass
    mixed = probs_from_logits(torch.cat([logits, logits[:1]]), mixed_t, torch.full((n + 1,), 5),
                              torch.full((n + 1,), 0.9))
    assert torch.equal(greedy, mixed[:n])
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("seed", range(4))
def test_all_greedy_verification_equals_the_general_pass(seed):
    """Random (not one-hot) target rows, drafts that agree with the argmax often, every draft count 0..K."""
    gen = torch.Generator().manual_seed(seed)
    batch, k = 16, 4
    p = torch.softmax(_tied_logits(batch * (k + 1), seed).view(batch, k + 1, VOCAB), -1)
    agree = torch.rand(batch, k, generator=gen) < 0.7
    drafts = torch.where(agree, p[:, :k].argmax(-1), torch.randint(0, VOCAB, (batch, k), generator=gen))
    num_draft = torch.arange(batch) % (k + 1)
    q = torch.softmax(torch.randn(batch, k, VOCAB, generator=gen), -1)
    fast = rejection_sample_tensors(p, drafts, q, num_draft, None, None, torch.ones(batch, dtype=torch.bool))
    # the same rows beside one sampled row go through the general pass
    p2, d2, q2 = torch.cat([p, p[:1]]), torch.cat([drafts, drafts[:1]]), torch.cat([q, q[:1]])
    greedy2 = torch.ones(batch + 1, dtype=torch.bool)
    greedy2[-1] = False
    general = rejection_sample_tensors(p2, d2, q2, torch.cat([num_draft, num_draft[:1]]), None, None, greedy2,
                                       torch.Generator().manual_seed(1))
    assert torch.equal(fast[0], general[0][:batch]) and torch.equal(fast[1], general[1][:batch])
    assert 0 < int(fast[0].sum()) < int(num_draft.sum())  # some drafts kept, some refused


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} ran for a request that asked for no option")
    return refused


def test_options_off_runs_no_option_code(monkeypatch):
    """Greedy requests without penalties, logprobs or grammar in AR, SD, n-gram SD and SSD: no processor, grammar
    mask, logprob or random draw runs (each is made to fail), and the outputs still equal AR's."""
    for module, name in [(processors_module, "_output_counts"), (processors_module, "_penalized"),
                         (GrammarState, "fill"), (logprobs_module, "token_logprobs"),
                         (sampler_module, "row_uniforms"), (rejection_module, "row_uniforms"),
                         (sampler_module, "inverse_cdf"), (rejection_module, "inverse_cdf")]:
        monkeypatch.setattr(module, name, _refuse(f"{module.__name__}.{name}"))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # a grammar mask would import it
    target = tiny_model(seed=2, layers=2)
    draft = truncated(target, 1)
    prompts = PROMPTS[:3]
    want = greedy_tokens(target, prompts, 12)
    for mode, llm in every_mode(target, draft):
        with llm:
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
        assert got == want, mode


def test_row_curve_reads_the_table_as_rows_time():
    """Piecewise-linear between the points, the first point's time below them, the last slope beyond them."""
    table = {"8": 3.0, "1": 1.0, "4": 2.5, "16": 3.5}
    curve = RowCurve.of(table)
    for n, seconds in [(0, 1.0), (1, 1.0), (2, 1.5), (6, 2.75), (16, 3.5), (40, 5.0), (2, 1.5)]:
        assert curve(n) == pytest.approx(seconds) and rows_time(table, n) == curve(n)


def test_live_costs_follow_a_replaced_table():
    """The n-gram proposer's chooser replaces the draft table after making the costs: the kept curve follows."""
    costs = LiveCosts({"1": 1.0, "8": 2.0}, {"1": 0.5, "8": 1.0})
    assert costs.draft_step(1) == 0.5
    costs.draft = {"1": 0.01}
    assert costs.draft_step(1) == 0.01 and costs.verify(8) == 2.0
