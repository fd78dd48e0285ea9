"""The cache tree changes only what the speculator prepares: greedy SSD equals AR token for token while the tree
changes every round (a scripted schedule over every tree the plan offers, both transports) and under the
adaptive default, in fp32; and a sequence at K = 0 beside a speculating one gets no draft and no branch."""
import pytest

from saguaro import LLM, SamplingParams
from saguaro.adapt_settings import TREE_OPTIONS, AdaptSettings
from saguaro.engine.model_runner import ModelRunner
from saguaro.ssd.plan import SpecPlan, TreeOption
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest
from saguaro.ssd.speculator import Speculator
from tests import test_adapt_exact as exact
from tests.test_adapt_exact import TOKENS, Scripted
from tests.tiny import PROMPTS

ar_outputs = exact.ar_outputs  # the weak pair's AR outputs (a module fixture; the pair is conftest's)


class CyclingTrees(Scripted):
    """K from a script, and the round's tree the next of the plan's ``trees`` each round."""

    def __init__(self, max_k: int, script: list[int], trees: int):
        super().__init__(max_k, script)
        self.trees, self.used = trees, []

    def _choose(self, seqs):
        self.tree = len(self.used) % self.trees
        self.used.append(self.tree)
        return super()._choose(seqs)


@pytest.mark.parametrize("transport", ["thread", "process"])
def test_every_tree_in_turn_equals_ar(pair, ar_outputs, transport):
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, block_size=4,
             fan_out=[2, 2, 2, 4], speculator_transport=transport,
             adapt=AdaptSettings(trees_without_profile=True, **TREE_OPTIONS)) as llm:  # no profile: trees asked for
        decoder = llm.engine.decoder
        assert decoder.plan.trees > 3  # the adaptive default's options beside the plan's own tree
        decoder.schedule = schedule = CyclingTrees(3, [3, 3, 1, 0, 2], decoder.plan.trees)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))
        assert decoder.failure is None
        hits = sum(o.spec_counts.cache_hits for o in outs)
    assert [o.token_ids for o in outs] == ar_outputs
    assert set(schedule.used) == set(range(decoder.plan.trees)) and hits > 0


def test_the_adaptive_trees_equal_ar_and_are_reported(pair, ar_outputs):
    adapt = AdaptSettings(prior=0.9, probe_interval=1, max_probe_interval=2, probe_budget=1.0,
                          trees_without_profile=True, **TREE_OPTIONS)
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, block_size=4, adapt=adapt,
             speculator_transport="thread") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))
    assert [o.token_ids for o in outs] == ar_outputs
    for o in outs:
        counts = o.spec_counts
        assert len(counts.fan_out_per_round) == len(counts.k_per_round)
        assert all((f > 0) == (k > 0) for f, k in zip(counts.fan_out_per_round, counts.k_per_round))
        assert o.spec.fan_out_per_round == counts.fan_out_per_round


def test_a_k_zero_sequence_beside_a_speculating_one_gets_no_draft_and_no_branch(pair):
    runner = ModelRunner(pair[1].model, 128, 4)
    plan = SpecPlan.fixed([2, 1, 1, 2])
    plan.options = [TreeOption([[[1, 1, 0, 1]]], [[[1, 1, 0, 1]]], [1])]
    spec = Speculator(runner, plan)
    rows_fed = []
    forward = runner.forward
    runner.forward = lambda items: rows_fed.append(sum(len(i.token_ids) for i in items)) or forward(items)
    admissions = [Admission(0, [3, 7, 1, 9], SamplingParams(), 0), Admission(1, [4, 2, 6], SamplingParams(), 1)]
    outcomes, bonus = [], 5
    for round_ in range(6):
        rows = spec.respond(RoundRequest(outcomes, admissions if not round_ else [], [], [0, 1], ks=[0, 3],
                                         tree=round_ % 2)).rows
        assert rows[0].tokens == [] and len(rows[1].tokens) == 3
        stats = spec.build()
        keys = spec.cache.keys()
        assert keys and {seq_id for seq_id, _, _ in keys} == {1}  # every branch is the speculating sequence's
        assert stats.branches == len(keys)
        assert spec.states[0].draft.num_cached == 0 and not spec.states[0].draft.block_table  # never fed
        seq_id, k, t = next(iter(keys))
        outcomes = [Outcome(0, 0, bonus), Outcome(1, k, t)]
    assert spec.states[0].seq.tokens == [3, 7, 1, 9] + [bonus] * 5
    assert rows_fed and all(n > 0 for n in rows_fed)
