"""Adaptive K at temperature > 0 samples exactly the target's distribution (50,000 samples per case).

K changes from round to round by what was verified before the round: a schedule driven by the verified
tokens themselves (the strongest dependence on history a chooser may have; in SSD it picks the round's
cache tree -- fan-outs and taper -- from them too), and the adaptive chooser (SSD: K and the tree) with
settings that make it move. The joint law of output tokens 3 and 4 (vocabulary 8: rounds after K has
changed) is compared with the exact AR law by total variation (threshold: tests/dist_harness.py). The
negative control lets a round's K depend on that round's own drafts -- speculation cut at its first odd
token, the dependence ``saguaro.adapt`` never has -- and must fail the same check, in SD and in SSD with the
trees changing.
"""
import pytest

import saguaro.sd.sd as sd_module
import saguaro.ssd.ssd_decoder as ssd_module

from saguaro import LLM, SamplingParams
from saguaro.engine.k_schedule import KSchedule
from saguaro.adapt_settings import TREE_OPTIONS, AdaptSettings
from saguaro.sd.types import Proposal
from tests.dist_harness import measure
from tests.tiny import perturbed, tiny_model

POSITIONS = [3, 4]
PARAMS = SamplingParams(temperature=1.0)
# drops to 0 (as soon as speculation is not predicted to pay), probes every other round; SSD's trees offered though
# the tiny pair has no calibration profile
MOVING = AdaptSettings(prior=0.9, probe_interval=1, max_probe_interval=2, probe_budget=1.0, stay_gain=1.02,
                       trees_without_profile=True, **TREE_OPTIONS)
TREES = AdaptSettings(trees_without_profile=True, **TREE_OPTIONS)


class FromHistory(KSchedule):
    """K = (sum of the verified output tokens + their count) mod (max K + 1): 0 to max, by history; SSD's tree
    the batch's verified token sum mod the plan's ``trees``."""

    def __init__(self, max_k: int, trees: int = 1):
        super().__init__(max_k)
        self.trees, self.used = trees, set()

    def _choose(self, seqs):
        self.tree = sum(sum(s.output_ids) for s in seqs) % self.trees
        self.used.add(self.tree)
        return [(sum(s.output_ids) + len(s.output_ids)) % (self.max_k + 1) for s in seqs]


def from_history(llm) -> FromHistory:
    plan = getattr(llm.engine.decoder, "plan", None)
    return FromHistory(3, plan.trees if plan is not None else 1)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=5, vocab=8, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.03)


def engine(pair, mode, **options):
    options.setdefault("adapt", TREES)
    if mode == "ssd":  # just-in-time misses: drafts the chooser prices, so that K moves on this pair
        options.setdefault("miss_strategy", "jit")
    return LLM(target=pair[0], draft=pair[1], mode=mode, num_speculative_tokens=3, block_size=4, max_num_seqs=1024,
               kv_cache_tokens=1024 * 16, speculator_transport="thread", **options)


def run(llm, schedule=None):
    try:
        if schedule is not None:
            llm.engine.decoder.schedule = schedule
        tv, threshold = measure(llm, llm.target, PARAMS, POSITIONS)
        assert getattr(llm.engine.decoder, "failure", None) is None
    finally:
        llm.close()
    return tv, threshold


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_k_from_history_distribution(pair, mode):
    llm = engine(pair, mode)
    schedule = from_history(llm)
    tv, threshold = run(llm, schedule)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert mode == "sd" or len(schedule.used) == schedule.trees > 1  # every tree the plan offers was built


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_adaptive_distribution(pair, mode):
    llm = engine(pair, mode, adapt=MOVING)
    ks, trees = [], set()
    schedule = llm.engine.decoder.schedule
    original = schedule.choose
    schedule.choose = lambda seqs: ks.extend(original(seqs)) or trees.add(schedule.tree) or ks[len(ks) - len(seqs):]
    tv, threshold = run(llm)
    assert 0 in ks and max(ks) > 0  # K moved
    assert mode == "sd" or len(trees) > 1  # so did the cache tree
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_negative_control_k_from_the_rounds_own_drafts_fails(pair, monkeypatch, mode):
    verify = sd_module.verify_round

    def peeking(target, seqs, p):
        tokens = p.tokens or [row[:n] for row, n in zip(p.device_tokens.tolist(), p.counts)]
        cut = [toks[:next((i for i, t in enumerate(toks) if t % 2), len(toks))] for toks in tokens]
        return verify(target, seqs, Proposal(cut, p.probs, p.point_mass))

    monkeypatch.setattr(sd_module if mode == "sd" else ssd_module, "verify_round", peeking)
    llm = engine(pair, mode, adaptive=mode == "ssd")  # SSD: the plan offers its trees, the history picks them
    tv, threshold = run(llm, from_history(llm) if mode == "ssd" else None)
    assert tv > threshold, f"the check did not catch a K chosen from the round's own drafts (TV {tv:.4f})"
