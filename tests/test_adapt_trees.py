"""SSD's cache tree per round (saguaro.adapt.trees, tree_choice, the schedule's ``tree``): the options fixed at
start-up, the plan's lookups of them, the wire, and the chooser's pick by the request's acceptance."""
import numpy as np
import pytest
import torch

from saguaro.adapt.costs import LiveCosts
from saguaro.adapt.schedule import TREE_INTERVAL, AdaptiveK, Priors, SSDModel
from saguaro.adapt.speed import BatchCosts
from saguaro.adapt.tree_choice import TreeModel
from saguaro.adapt.trees import geometric, scaled, tree_options
from saguaro.adapt_settings import TREE_OPTIONS, AdaptSettings
from saguaro.calibration.profile import DEFAULTS, default_profile
from saguaro.config import Config
from saguaro.engine.sequence import Sequence
from saguaro.sampling.params import SamplingParams
from saguaro.ssd.plan import SpecPlan, TreeOption
from saguaro.ssd.protocol import RoundRequest, pack_request, unpack_request
from saguaro.ssd_settings import DraftedBy
from saguaro.theory import integer_geometric_fanout

K = 3


def profile():
    return default_profile("t", "d", torch.float32, k=K)


def test_the_options_scale_reshape_and_taper_the_plans_tree():
    plan = SpecPlan.fixed([2, 2, 2, 4])
    options = tree_options(plan, profile(), AdaptSettings(**TREE_OPTIONS))
    lists = [o.primary[0][0] for o in options]
    assert lists[:2] == [[1, 1, 1, 2], [4, 4, 4, 8]]  # the plan's shape at half and twice its budget
    shallow, deep = (list(integer_geometric_fanout(a, DEFAULTS["r_p"], K, 10, 64)) for a in (0.3, 0.9))
    assert lists[2:4] == [shallow, deep] and shallow[0] > deep[0] and deep[K] > shallow[K]
    assert lists[4] == [2, 2, 2, 4] and options[4].branch_steps == [1]  # the plan's fan-outs, tapered
    assert all(o.backup[0][0] == o.primary[0][0] for o in options)  # the plan's backup lists were the same
    assert tree_options(plan, profile(), AdaptSettings(fan_out_scales=(), fan_out_shapes=(), taper=False)) == []
    assert tree_options(plan, profile(), AdaptSettings()) == []  # the default: the plan's own tree only
    same = tree_options(plan, profile(), AdaptSettings(fan_out_scales=(1.0, 0.5, 0.5), taper=True))
    assert [o.primary[0][0] for o in same] == [[1, 1, 1, 2], [2, 2, 2, 4]]  # copies of a tree are left out
    tapered = SpecPlan.fixed([2, 2, 2, 4], branch_steps=2)
    assert tree_options(tapered, profile(), AdaptSettings(taper=True))[0].branch_steps == [
        None]  # the other taper of a tapered plan: the full tree
    assert scaled([1, 0, 0, 1], 0.1) == [1, 0, 0, 0] and geometric([0, 0, 0, 0], 0.5, 1.0) == [0, 0, 0, 0]


@pytest.mark.parametrize("bad, message", [(dict(fan_out_scales=[0.0]), "fan_out_scales"),
                                          (dict(fan_out_shapes=[1.0]), "fan_out_shapes"),
                                          (dict(fan_out_shapes=[0.0]), "fan_out_shapes")])
def test_tree_settings_out_of_range_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        AdaptSettings(**bad)
    with pytest.raises(ValueError, match=message):
        Config(target="t", draft="d", mode="ssd", adapt=bad)
    assert AdaptSettings(fan_out_scales=[0.5]).fan_out_scales == (0.5,)  # a JSON list is taken


def test_trees_are_offered_with_a_calibrated_profile_or_when_asked(monkeypatch):
    """The trees are opt-in (``TREE_OPTIONS``), and scored by the profile's hit curves: without a stored profile
    (the documented defaults, a guess) the plan keeps its own tree only, unless ``trees_without_profile``; with
    one, it gains the options asked for."""
    from dataclasses import replace

    import saguaro.adapt.build as build
    cfg = Config(target="t", draft="d", mode="ssd", dtype="bfloat16", num_speculative_tokens=K,
                 adapt=AdaptSettings(**TREE_OPTIONS))
    plan = SpecPlan.fixed([1, 1, 1, 2])
    assert build.ssd_schedule(cfg, plan)[0].trees == 1
    asked = replace(cfg, adapt=AdaptSettings(trees_without_profile=True, **TREE_OPTIONS))
    assert build.ssd_schedule(asked, plan)[0].trees > 1
    monkeypatch.setattr(build, "_profile", lambda c: replace(default_profile("t", "d", "bfloat16", K),
                                                             default=False))  # as if calibrated
    assert build.ssd_schedule(cfg, plan)[0].trees > 1
    assert build.ssd_schedule(replace(cfg, adapt=AdaptSettings()), plan)[0].trees == 1  # the default: not asked


def test_the_plan_looks_up_every_tree():
    plan = SpecPlan.fixed([1, 1, 1, 1])
    plan.options = [TreeOption([[[4, 0, 0, 0]]], [[[0, 0, 0, 5]]], [1])]
    assert plan.trees == 2 and plan.max_fan_out() == 5
    assert plan.fan_out(0.0, DraftedBy.PRIMARY, 3, tree=1) == [4, 0, 0, 0]
    assert plan.fan_out(0.0, DraftedBy.BACKUP, 1, tree=1) == [0, 0, 0, 5]
    assert plan.branch_widths(4, 0.0, tree=1) == [4, 1, 1] and plan.branch_widths(4, 0.0) == [4, 4, 4]
    with pytest.raises(ValueError, match="tree 2"):
        plan.fan_out(0.0, DraftedBy.PRIMARY, 1, tree=2)
    with pytest.raises(ValueError, match="K\\+1"):
        SpecPlan(K, [0.0], [[[1] * 4]], [[[1] * 4]], [1.0], options=[TreeOption([[[1, 1]]], [[[1, 1]]])])
    with pytest.raises(ValueError, match="branch_steps"):
        SpecPlan(K, [0.0], [[[1] * 4]], [[[1] * 4]], [1.0], options=[TreeOption([[[1] * 4]], [[[1] * 4]], [5])])


def test_the_round_s_tree_crosses_the_wire():
    back = unpack_request(pack_request(RoundRequest(order=[4, 2], ks=[3, 0], tree=5, prepare=[3, 1], catch_up=[2])))
    assert (back.order, back.ks, back.tree, back.prepare, back.catch_up) == ([4, 2], [3, 0], 5, [3, 1], [2])
    plain = unpack_request(pack_request(RoundRequest()))
    assert plain.tree == 0 and plain.prepare is None and plain.catch_up == []


def chooser(options: list[TreeOption]) -> AdaptiveK:
    """Over the plan [1, 1, 1, 1] and ``options``, the default profile's hit curves and costs."""
    plan = SpecPlan.fixed([1, 1, 1, 1])
    plan.options = options
    prof = profile()
    trees = TreeModel(plan, prof.timing, [prof.temperatures["0.0"].primary])
    return AdaptiveK(K, AdaptSettings(), LiveCosts.from_timing(prof.timing), Priors([0.0], [[0.75]], [0.3], [0.5]),
                     SSDModel(lambda b: True, 0.5, 1.0, trees))


def seq() -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(max_tokens=100))


SHALLOW, DEEP = TreeOption([[[4, 0, 0, 0]]], [[[4, 0, 0, 0]]]), TreeOption([[[0, 0, 0, 4]]], [[[0, 0, 0, 4]]])


def test_a_request_that_accepts_little_wants_shallow_guesses_one_that_accepts_much_deep_ones():
    c, low, high = chooser([SHALLOW, DEEP]), seq(), seq()
    for i in range(12):
        c.observe(low, K, 0, hit=False)
        # every draft accepted, half the rounds a hit in the plan's tree: more guesses at the deep outcome pay
        # (were every round a hit, the plan's one guess would do, and its cheaper build win)
        c.observe(high, K, K, hit=i % 2 == 0)
    gains = c.tree_gains([low, high], BatchCosts.at(c.costs, 2, K))
    assert gains.shape == (3, 2, K + 1)
    assert gains[1, 0, 1:].max() > gains[2, 0, 1:].max()  # shallow beats deep for the request that rejects
    assert gains[2, 1, K] > gains[1, 1, K]  # deep beats shallow for the one that accepts all
    alone = c.tree_gains([high], BatchCosts.at(c.costs, 1, K))[2, 0]
    ks = c.choose([high])
    assert c.tree == 2 and ks == [1 + int(np.argmax(alone[1:]))]  # its best K in the deep tree, alone
    assert high.spec.fan_out_per_round == [4]  # the branches asked of the build for it
    c.observe_verify(K + 1, 1.0)  # sets the target's scale, and the draft's while the draft is untimed
    step = c.costs.draft_step(1)
    c.observe_build(0.5, K)  # this build ran in the tree sent the round before (the same here), all K steps
    assert c.build_scale == pytest.approx(0.5 / c.sent[0][1][K])
    c.build_scale, ratio = None, c.build_scale
    short = ratio * c.sent[0][1][K // 2]  # interrupted, or a smaller K: compared with the prediction at its steps
    c.observe_build(short, K // 2)
    assert c.build_scale == pytest.approx(ratio) and short < 0.5 * (K // 2 + 1) / (K + 1)  # the glue is cheap
    # a build is draft passes: its measured scale is the draft's (a just-in-time miss is priced by it)
    assert c.costs.draft_step(1) == pytest.approx(step * c.build_scale / c.costs.target_scale)


def test_a_tree_s_hit_rate_moves_the_measured_one_by_the_model_s_difference():
    c, s = chooser([SHALLOW]), seq()
    for _ in range(12):
        c.observe(s, K, 0, hit=True)  # hits far above what the model says of the plan's tree
    observed = c.states[s.seq_id].hit_rate.rate(0)
    weights = np.array([c.states[s.seq_id].estimate.outcome_pmf(K)])
    own, shallow = (c.ssd.trees.model_hits(c.ssd.trees.fan_outs([s], t, 1), weights, [0])[0] for t in (0, 1))
    assert shallow > own
    gains = c.tree_gains([s], BatchCosts.at(c.costs, 1, K))
    assert gains[1, 0, 1] > gains[0, 0, 1] and observed > 0.9


def test_every_tree_is_scored_every_few_rounds_and_when_the_batch_changes(monkeypatch):
    """Scoring every tree costs milliseconds of host time per round at batch 1: the chooser scores them all every
    ``TREE_INTERVAL`` rounds of one batch (and at once when the batch changes), the chosen tree in between."""
    c, a, b = chooser([SHALLOW, DEEP]), seq(), seq()
    calls, real = [], c.tree_gains
    monkeypatch.setattr(c, "tree_gains", lambda seqs, costs, only=None, depths=None:
                        calls.append((only, depths)) or real(seqs, costs, only, depths=depths))

    def scored() -> list:  # every tree scored (None)
        return [only for only, depth in calls if only is None]

    for _ in range(TREE_INTERVAL + 1):
        c.choose([a])
        c.observe(a, K, 1, hit=True)  # a verified round: the next one's gains are new
    assert scored() == [None, None]  # every tree at the first round and after the interval
    # and every round the chosen one, alone at its own depth
    assert [(only, depths) for only, depths in calls if only is not None] == [([c.tree], [None])] * (TREE_INTERVAL + 1)
    calls.clear()
    c.choose([a, b])
    assert scored() == [None]  # a new batch; of two, the chosen tree is priced at each build depth
    assert [(only, depths) for only, depths in calls if only is not None] == [([c.tree], list(range(1, K + 1)))]


def test_a_batch_that_verified_no_draft_keeps_its_gains_for_a_few_rounds(monkeypatch):
    """Rounds at K = 0 (AR steps) teach the chooser nothing: it keeps the last gains for ``TREE_INTERVAL`` such
    rounds instead of scoring again, so an AR step does not pay for it; it chooses what it would have chosen.
    A verified draft, a new batch, or the interval's end score again."""
    c, fresh, a, b = chooser([SHALLOW, DEEP]), chooser([SHALLOW, DEEP]), seq(), seq()
    twin = seq()  # the same request for the other chooser (a request's K history is its own)
    for x in (c, fresh):
        # K = 0, probes
        x.settings = AdaptSettings(min_gain=100.0, probe_interval=3, max_probe_interval=3, probe_budget=1.0)
    # one entry per round whose gains were computed: the chosen tree's (at every build depth at once)
    scored, real = [], c.tree_gains
    monkeypatch.setattr(c, "tree_gains", lambda seqs, costs, only=None, depths=None:
                        (only is not None and scored.append(only)) or real(seqs, costs, only, depths=depths))
    ks, expected = [], []
    for _ in range(2 * (TREE_INTERVAL + 1) + 1):
        ks.append(c.choose([a])[0])
        fresh._rest = None  # a chooser that scores every round
        expected.append(fresh.choose([twin])[0])
    assert ks == expected and 0 in ks and max(ks) > 0  # the same K's, probes included
    assert len(scored) == 3  # at rounds 0, TREE_INTERVAL + 1 and 2 * (TREE_INTERVAL + 1): none between
    c.observe(a, 1, 0, hit=False)  # a probe verified: its gains move
    c.choose([a])
    c.choose([a, b])  # another batch
    assert len(scored) == 5


def test_a_shallow_build_of_a_wide_tapered_tree_costs_its_wide_steps():
    """The build at K is the glue and K steps, the wide ones first: a K = 1 build of a tree that decodes 12
    branches for 2 steps, then 1, costs the glue and one 12-row pass, far more than 2 / 6 of the whole K = 5
    build (the mean pass, which the narrow tail makes cheap)."""
    from saguaro.calibration.timeline import build_cost, rows_time
    timing = profile().timing
    cost = build_cost(timing, 5, 1, 12, branch_steps=2, deep=1)
    glue, wide, narrow = (rows_time(timing.draft_rows, n) for n in (1, 12, 1))
    assert cost == pytest.approx(np.cumsum([glue, wide, wide, narrow, narrow, narrow]))
    assert cost[1] / 2 > cost[5] / 6
    c = chooser([TreeOption([[[6, 6, 0, 0]]], [[[6, 6, 0, 0]]], [2])])
    build, deep = c.ssd.trees.build([seq()], 1, 1, K), c.ssd.trees.plan.deep_branches
    # a K-draft speculation's branches: its guesses at depths 0..K - 1 and F_K's (none here: at least one row)
    assert build.cost == pytest.approx([build_cost(timing, k, 1, n, 2, deep)[k] for k, n in enumerate([1, 6, 12, 12])])


def test_a_build_that_outlasts_the_verification_is_cut_and_its_hits_carry_the_steps_it_made():
    """Drafts as dear as the verification: a build asked for K makes the glue and one step before the
    verification ends (the pass in flight finishes), so at every K >= 1 it lasts the glue and a step, and a hit
    carries one token: the chooser's hit tokens and build time at K are those of K = 1."""
    prof = profile()
    prof.timing.draft_rows = {n: 2.0 * t for n, t in prof.timing.target_rows.items()}
    plan = SpecPlan.fixed([1, 1, 1, 1])
    c = AdaptiveK(K, AdaptSettings(), LiveCosts.from_timing(prof.timing), Priors([0.0], [[0.9]], [0.3], [0.9]),
                  SSDModel(lambda b: True, 0.5, 1.0, TreeModel(plan, prof.timing, [prof.temperatures["0.0"].primary])))
    build = c.ssd.trees.build([seq()], 0, 1, K)
    assert list(build.done) == [0, 1, 1, 1]
    assert build.cut_s[1] == pytest.approx(build.cost[1]) and (build.cut_s[2:] < build.cost[2:]).all()
    gains = c.tree_gains([seq()], BatchCosts.at(c.costs, 1, K))[0, 0]
    assert gains[2] < gains[1] and gains[3] < gains[1]  # the same tokens and build, a dearer verification


def test_a_seeded_request_s_hit_rate_is_the_model_s_at_its_own_acceptance():
    """A seeded sampled request chooses from the profile alone, so that its K, and so its draws, do not depend on a
    clock, a batch or a build's timing (which decides a measured hit). Its hit rate still follows how far it
    accepts, through the profile's hit curves at its outcome law in the plan's tree: the prior's flat rate would
    price a request that accepts everything like one that accepts nothing."""
    def run(prior_hit: float, hit, verify_s: float, batch: int):
        plan, prof = SpecPlan.fixed([2, 2, 2, 4]), profile()
        trees = TreeModel(plan, prof.timing, [prof.temperatures["0.0"].primary])
        c = AdaptiveK(K, AdaptSettings(), LiveCosts.from_timing(prof.timing),
                      Priors([0.0], [[0.75]], [0.3], [prior_hit]), SSDModel(lambda b: True, 0.5, 1.0, trees))
        high, low = (Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=s, max_tokens=100)) for s in (7, 8))
        for i in range(12):
            c.observe_verify(K + 1, verify_s)  # the machine's measured speed differs between the runs
            c.observe(high, K, K, hit=hit(i))
            c.observe(low, K, 0, hit=hit(i))
        return c, (high, low), c.choose([high, low] + [seq() for _ in range(batch - 2)])[:2], c._rest[1][:2]

    c, seqs, ks, gains = run(0.5, lambda i: True, 0.01, 2)
    for prior_hit, hit, verify_s, batch in [(0.0, lambda i: False, 0.5, 8), (1.0, lambda i: i % 2 == 0, 0.02, 3)]:
        _, _, other_ks, other = run(prior_hit, hit, verify_s, batch)
        assert other_ks == ks and np.allclose(other, gains)  # neither prior, measured hits, clock nor batch
    weights = np.array([c.states[s.seq_id].estimate.outcome_pmf(K) for s in seqs])
    model = c.ssd.trees.model_hits(c.ssd.trees.fan_outs(list(seqs), 0, 1), weights, [0, 0])
    assert model[0] != pytest.approx(model[1], abs=0.05)  # the two requests' own hit rates
    flat = [c.gains(list(seqs), BatchCosts.at(c.profile, 1, K), True) for c.priors.p_hit[0] in (0.0, 1.0)]
    assert not np.allclose(flat[0], flat[1])  # the flat prior would have moved them
    assert ks[0] > 0 and ks[1] == 0  # all accepted: speculate; nothing accepted: AR
