"""SSD's build depth per round (saguaro.adapt.depth, ``TreeModel.build(depth=)``, the answer by depth): the
batch's build goes as deep as its deepest K, so the chooser prices every request at each depth, takes one for
the batch, and keeps each K within it."""
import numpy as np
import pytest

from saguaro.adapt.depth import batch_depth
from saguaro.adapt.speed import BatchCosts
from saguaro.ssd.plan import SpecPlan
from tests.test_adapt_trees import K, chooser, profile, seq
from saguaro.adapt.tree_choice import TreeModel


def test_a_build_deeper_than_the_k_verified_is_waited_for_and_carries_no_more():
    """At K = 1 beside a build of 3 steps, the verification of two rows a sequence ends before the build: the
    hit carries its one step as before, and the round waits for the pass in flight (a later cut). At K = depth
    and above, the build is K's own."""
    prof = profile()
    trees = TreeModel(SpecPlan.fixed([1] * (K + 1)), prof.timing, [prof.temperatures["0.0"].primary])
    seqs = [seq() for _ in range(5)]
    own, deep = trees.build(seqs, 0, 5, K), trees.build(seqs, 0, 5, K, depth=K)
    assert deep.done[1] == own.done[1] == 1
    assert deep.cut_s[1] > own.cut_s[1]  # the deeper build's pass in flight
    assert (deep.cost == own.cost).all() and deep.cut_s[K] == own.cut_s[K] and deep.done[K] == own.done[K]
    assert trees.build(seqs, 0, 5, K, depth=1).cut_s[1:] == pytest.approx(own.cut_s[1:])  # depth 1: K's own


def test_the_batch_takes_the_depth_whose_best_gains_sum_highest():
    one = np.array([[1.0, 1.3, 0.0, 0.0], [1.0, 1.1, 0.0, 0.0]])
    two = np.array([[1.0, 1.2, 1.6, 0.0], [1.0, 0.9, 1.0, 0.0]])  # the first gains at 2, the second loses
    three = np.array([[1.0, 1.2, 1.5, 1.55], [1.0, 0.8, 0.9, 0.9]])
    bar, counted = np.array([1.02, 1.02]), np.array([True, True])
    # sums 1.3 + 1.1, 1.6 + 1.0 (the second's best is below its bar: it counts K = 0's), 1.55 + 1.0
    assert batch_depth([one, two, three], bar, 1.0, counted) == 2
    three[0, 3] = 1.7  # now the first gains more at 3 than the second loses (it is at K = 0 from depth 2)
    assert batch_depth([one, two, three], bar, 1.0, counted) == 3
    assert batch_depth([one, two, three], np.array([1.02, 1.2]), 1.0, counted) == 3  # its bar: K = 0 at any depth
    assert batch_depth([one, two, three], bar, 1.0, np.array([False, True])) == 1  # only the second counts
    assert batch_depth([one, one, one], bar, 1.0, counted) == 1  # equals: the shallowest


def test_the_chooser_keeps_every_k_within_the_batch_s_depth():
    """Five requests that accept little and one that accepts every draft: alone, the one would ask the most K;
    with the five beside it, the depth is the batch's best sum, and no K passes it."""
    c = chooser([])
    low, high = [seq() for _ in range(5)], seq()
    for i in range(12):
        for s in low:
            c.observe(s, K, 1, hit=True)
        c.observe(high, K, K, hit=True)
    batch = low + [high]
    ks = c.choose(batch)
    costs = BatchCosts.at(c.costs, len(batch), K)
    by_depth = list(c.tree_gains(batch, costs, [0], depths=list(range(1, K + 1)))[0])
    zero = c.zero_gain(len(batch))
    bars = np.full(len(batch), c.settings.min_gain * zero)
    assert c.depth == batch_depth(by_depth, bars, zero, np.ones(len(batch), bool))
    assert max(ks) <= c.depth
    alone, twin = chooser([]), seq()
    for _ in range(12):
        alone.observe(twin, K, K, hit=True)
    own = alone.choose([twin])[0]
    assert alone.depth is None  # alone, no depth to share: its own best K (no sweep of depths)
    assert ks[-1] < own  # the five held it below that


def test_the_answer_is_measured_and_priced_by_the_build_s_depth():
    c = chooser([])
    c.observe_answer(5, 0.05, depth=3)
    c.observe_answer(5, 0.01, depth=1)
    assert c.answer_s(5) == pytest.approx(0.8 * 0.05 + 0.2 * 0.01)  # the batch size's, every depth
    assert c.answer_s(5, 3) == 0.05 and c.answer_s(5, 1) == 0.01 and c.answer_s(5, 2) == c.answer_s(5)
    assert c.answers(5, 3)[1:] == pytest.approx([0.05] * K)  # below the depth: the deeper build's wait
    assert c.answers(5)[1:] == pytest.approx([0.01, c.answer_s(5), 0.05])  # each K its own
    s = [seq() for _ in range(5)]
    costs = BatchCosts.at(c.costs, 5, K)
    shallow, deep = c.tree_gains(s, costs, [0], depths=[1, 3])[0]
    assert (deep[:, 1] < shallow[:, 1]).all()  # K = 1 beside a 3-step build pays its wait
