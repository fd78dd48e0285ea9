"""Chunks sized by time (``max_prefill_tokens="auto"``): the fitted costs recover the costs a pass really has,
the chosen chunk is the largest whose predicted pass fits the budget and follows the costs (the context
already cached included), it is never 0 and never more than the prompt has left, and outputs stay exact
(greedy AR, SD and SSD with timed chunks, chunks ending mid-block, equal unchunked AR). The engine-level tests
inject the costs: a clock that each prefill pass advances by a known cost model."""
import math
import random

import pytest

from saguaro import LLM, SamplingParams
from saguaro.config import Config
from saguaro.engine.prefill_chunks import (PROBE_TOKENS, FixedChunks, PrefillCost, PrefillCosts, TimedChunks,
                                           prefill_chunks)
from tests.tiny import PROMPTS, arriving, greedy_tokens

import torch

LONG = [(7 * i + 3) % 64 for i in range(203)]  # 203 tokens: chunks end mid-block (block_size 4)
COST = PrefillCost(fixed=0.004, per_token=0.001, per_pair=2e-6)  # what the injected clock charges a pass


def _timed(cost: PrefillCost, budget_s: float, steps: list) -> TimedChunks:
    """A chunker that has timed ``steps`` (lists of rows) costing what ``cost`` says."""
    chunks = TimedChunks(budget_s)
    for rows in steps:
        chunks.costs.observe(rows, cost.fixed + sum(cost.seconds(n, c) for n, c in rows))
    return chunks


def test_fit_recovers_the_costs():
    rng = random.Random(0)
    steps = [[(rng.randint(1, 500), rng.randint(0, 4000)) for _ in range(rng.randint(1, 3))] for _ in range(20)]
    fitted = _timed(COST, 0.25, steps).costs.cost
    assert all(math.isclose(getattr(fitted, k), getattr(COST, k), rel_tol=1e-6) for k in ("fixed", "per_token",
                                                                                            "per_pair"))


def test_fit_has_no_negative_cost():
    costs = PrefillCosts()
    for n, t in [(10, 0.5), (20, 0.5), (40, 0.6), (80, 0.55)]:  # noisy: a falling trend would fit a negative cost
        costs.observe([(n, 0)], t)
    c = costs.cost
    assert min(c.fixed, c.per_token, c.per_pair) >= 0 and c.per_token > 0


def test_the_chunk_is_the_largest_that_fits():
    chunks = _timed(COST, 0.25, [[(n, c)] for n in (32, 64, 128, 256) for c in (0, 1000, 3000)])
    for cached in (0, 500, 2000, 8000):
        n = chunks.split([(10**6, cached)])[0]
        assert COST.fixed + COST.seconds(n, cached) <= 0.25 < COST.fixed + COST.seconds(n + 1, cached)
    early, late = chunks.split([(10**6, 0)])[0], chunks.split([(10**6, 8000)])[0]
    assert late < early  # a chunk late in a long prompt costs more per token


def test_the_chunk_follows_the_measured_costs():
    steps = [[(n, c)] for n in (32, 64, 128, 256) for c in (0, 2000)]
    cheap, dear = _timed(COST, 0.25, steps), _timed(PrefillCost(0.004, 0.004, 2e-6), 0.25, steps)
    assert dear.split([(10**6, 100)])[0] < cheap.split([(10**6, 100)])[0]
    attention = _timed(PrefillCost(0.004, 0.001, 2e-4), 0.25, steps)  # attention dearer: late chunks shrink more
    ratio = lambda c: c.split([(10**6, 6000)])[0] / c.split([(10**6, 0)])[0]  # noqa: E731
    assert ratio(attention) < ratio(cheap)
    assert _timed(COST, 1.0, steps).split([(10**6, 100)])[0] > cheap.split([(10**6, 100)])[0]  # a larger budget


def test_bounds_never_zero_never_past_the_prompt():
    rng = random.Random(1)
    for _ in range(300):
        cost = PrefillCost(rng.choice([0, 0.01, 1.0]), rng.choice([1e-6, 1e-3, 1.0]), rng.choice([0, 1e-7, 1e-2]))
        chunks = _timed(cost, rng.choice([1e-4, 0.025, 0.25, 10.0]), [[(rng.randint(1, 4096), 0)]])
        wants = [(rng.randint(1, 5000), rng.randint(0, 30000)) for _ in range(rng.randint(1, 4))]
        sizes = chunks.split(wants)
        assert sizes[0] >= 1 and all(0 <= n <= want for n, (want, _) in zip(sizes, wants))
        assert all(sizes[i] > 0 or sizes[i + 1] == 0 for i in range(len(sizes) - 1))  # admission order
        assert sum(sizes) <= max(2 * chunks.costs.largest, sizes[0])  # not far past what was timed
        assert chunks.step_tokens >= 1


def test_probe_growth_and_floor():
    chunks = TimedChunks(0.25)
    assert chunks.split([(1000, 0)]) == [PROBE_TOKENS] and chunks.step_tokens == PROBE_TOKENS
    free = _timed(PrefillCost(0.0, 1e-6, 0.0), 0.25, [[(32, 0)]])
    assert free.split([(10**6, 0)]) == [64]  # at most twice the largest timed chunk
    weights = _timed(PrefillCost(0.5, 0.01, 0.0), 0.25, [[(32, 0)], [(64, 0)]])  # the pass alone is over budget
    assert weights.split([(10**6, 0)]) == [50]  # a chunk whose tokens cost what the pass does, not one token
    attention = _timed(PrefillCost(0.5, 0.01, 0.01), 0.25, [[(32, 0)], [(64, 0)], [(16, 9)]])
    assert attention.split([(10**6, 1000)]) == [1]  # where one token costs more than the pass, one token


def test_late_in_a_long_prompt_a_chunk_grows_at_most_twice_the_windows_largest():
    """Late in a long prompt the window's steps are alike (about 40 tokens at 6,900 cached, each taking the
    budget), and the fit may put it all in the pass's fixed cost (over the budget), whose floor then asks for a
    thousand tokens. The cap is twice the window's largest step, not a large chunk timed early in the prompt:
    measured, that step took 2.8 s against 0.35 s predicted (SmolLM2-135M, one Zen 4 core)."""
    rng = random.Random(2)
    chunks = TimedChunks(0.25)
    chunks.costs.observe([(676, 0)], 0.30)  # early: a large chunk, little context
    for _ in range(40):  # late: the window's steps, alike
        chunks.costs.observe([(rng.randint(38, 42), 6900 + rng.randint(0, 100))], 0.25 + rng.uniform(-0.01, 0.01))
    assert chunks.costs.largest <= 42
    (n,) = chunks.split([(1100, 7000)])
    assert 1 <= n <= 2 * 42


def test_step_tokens_when_the_pass_alone_is_over_budget():
    """A fitted fixed cost over the budget (a big model on a loaded machine) admits a token a step: never a math
    error, which failed every request in flight."""
    over = _timed(PrefillCost(0.5, 0.01, 0.01), 0.25, [[(32, 0)], [(64, 0)], [(16, 9)]])
    assert over.step_tokens == 1 and PrefillCost(0.5, 0.01, 0.01).most_tokens(-0.25, 0) == 0


def test_a_pass_over_budget_with_attention_still_sizes_a_chunk():
    """A loaded machine: the pass's fixed cost alone exceeds the budget while attention has a cost too (the
    budget left is negative, which the quadratic's root must not take)."""
    cost = PrefillCost(0.5, 1e-4, 1e-7)
    chunks = _timed(cost, 0.25, [[(n, c)] for n in (32, 64, 128) for c in (0, 1000)])
    assert math.isclose(chunks.costs.cost.fixed, 0.5, rel_tol=1e-6)
    assert chunks.step_tokens >= 1
    first = chunks.split([(10**6, 500), (10**6, 0)])
    assert first[0] == math.ceil(cost.fixed / cost.seconds(1, 500)) or first[0] == 2 * 128  # the floor, or the cap
    assert first[1] == 0


def test_a_number_fixes_the_chunk():
    chunks = prefill_chunks(5, None, torch.device("cpu"))
    assert isinstance(chunks, FixedChunks) and not isinstance(chunks, TimedChunks)
    assert chunks.split([(3, 0), (4, 0), (9, 0)]) == [3, 2, 0]
    assert prefill_chunks("auto", None, torch.device("cpu")).budget_s == 0.25
    assert prefill_chunks("auto", None, torch.device("cuda", 0)).budget_s == 0.025
    assert prefill_chunks("auto", 0.1, torch.device("cpu")).budget_s == 0.1


@pytest.mark.parametrize("bad", [0, -3, "fast", 1.5, True, None])
def test_bad_chunk_settings_are_refused(bad):
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Config(target="t", max_prefill_tokens=bad)


@pytest.mark.parametrize("bad", [0, -0.1, math.inf, math.nan, "1"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="prefill_step_budget_s"):
        Config(target="t", prefill_step_budget_s=bad)
    with pytest.raises(ValueError, match="fixes them"):
        Config(target="t", max_prefill_tokens=64, prefill_step_budget_s=0.1)


class Clock:
    """The time the injected costs say: each target pass advances it by its cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _inject(llm: LLM, cost: PrefillCost, budget_s: float) -> list[list[tuple[int, int]]]:
    """Time the engine's chunks with ``cost``; return the rows of every prefill pass."""
    clock, passes = Clock(), []
    llm.engine.scheduler.chunks = TimedChunks(budget_s, clock=clock)
    target = llm.engine.target
    real = target.forward

    def forward(items):
        rows = [(len(i.token_ids), i.start) for i in items if i.tree is None]
        if all(i.logits != "all" for i in items):  # a prefill pass (verification wants every row's logits)
            passes.append(rows)
        clock.now += cost.fixed + sum(cost.seconds(n, c) for n, c in rows)
        return real(items)
    target.forward = forward
    return passes


@pytest.fixture(scope="module")
def reference(pair):
    return greedy_tokens(pair[0], PROMPTS + [LONG], 12)


MODES = [("ar", {}), ("sd", dict(num_speculative_tokens=3)),
         ("ssd", dict(num_speculative_tokens=3, fan_out=[2, 2, 2, 4], speculator_transport="thread"))]


@pytest.mark.parametrize("mode, options", MODES, ids=[m[0] for m in MODES])
def test_timed_chunks_are_exact_and_fit(pair, reference, mode, options):
    """Requests arrive while others decode; the long prompt's chunks follow the injected costs (each pass within
    the budget once timed, later ones smaller) and every output equals unchunked AR."""
    budget = 0.12
    draft = pair[1] if mode != "ar" else None
    with LLM(target=pair[0], draft=draft, mode=mode, block_size=4, enforce_eager=True, **options) as llm:
        passes = _inject(llm, COST, budget)
        engine = llm.engine
        seqs = arriving(engine, PROMPTS + [LONG], SamplingParams(max_tokens=12))
        assert getattr(engine.decoder, "failure", None) is None
        assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
    assert [s.output_ids for s in seqs] == reference
    assert all(COST.fixed + sum(COST.seconds(n, c) for n, c in rows) <= budget for rows in passes[1:])
    largest, chosen = 0, []
    for rows in passes:  # the long prompt's chunks after its first: the most that fit, or the cap, or the rest
        (n, cached), = rows if len(rows) == 1 else [(0, 0)]
        if cached > 0 and n > 1:
            want = min(2 * max(largest, PROBE_TOKENS // 2), COST.most_tokens(budget - COST.fixed, cached),
                       len(LONG) - cached)
            assert abs(n - want) <= 1, (rows, want)
            chosen.append(n)
        largest = max(largest, sum(n for n, _ in rows))
    assert len(chosen) >= 3 and any(n % 4 for n in chosen)  # chunked, some ending mid-block


def test_abort_mid_prefill_frees_every_block(pair):
    with LLM(pair[0], block_size=4, enforce_eager=True) as llm:
        _inject(llm, COST, 0.05)
        engine = llm.engine
        seq = engine.add_request(LONG, SamplingParams(max_tokens=4))
        engine.step()
        engine.step()
        assert 0 < seq.num_cached < len(LONG)
        engine.abort(seq)
        assert not engine.has_unfinished and engine.target.blocks.num_free == engine.target.blocks.num_blocks
