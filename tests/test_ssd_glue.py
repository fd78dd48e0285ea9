"""The speculator's draft cache between rounds: one-row glues, adopted branch k/v, and no leaked blocks.

After a hit the branch's k/v is copied from the build's scratch, after just-in-time drafting it is
already in place, so the next glue feeds only the last drafted token. Whatever the path, the draft
cache must hold exactly what a fresh prefill of the same tokens gives, and every block must come
back when the sequences leave.
"""
import pytest
import torch

from saguaro import SamplingParams
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.kv.kv_cache import KVCache
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.speculator import Speculator
from tests.tiny import perturbed, tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def draft():
    return perturbed(tiny_model(seed=5, vocab=48, layers=2), noise=0.05)


def test_copy_slots_moves_every_layer():
    cache = KVCache(tiny_model(seed=1, vocab=16, layers=2).config, 4, BLOCK, torch.float32)
    cache.data.normal_()
    before = cache.data.clone()
    cache.copy_slots([1, 2, 9], [12, 13, 14])
    assert torch.equal(cache.data[:, :, [12, 13, 14]], before[:, :, [1, 2, 9]])
    assert torch.equal(cache.data[:, :, :12], before[:, :, :12])


def _reference_kv(draft, tokens: list[int]) -> torch.Tensor:
    """The draft's k/v for ``tokens`` from one fresh prefill: [layers, 2, n, heads, dim]."""
    runner = ModelRunner(draft.model, 64, BLOCK)
    table: list[int] = []
    runner.blocks.reserve(table, len(tokens))
    runner.forward([ForwardItem(tokens, 0, table, "none")])
    return runner.cache.data[:, :, runner.slots(table, 0, len(tokens))]


def _glue_lengths(spec: Speculator) -> list[int]:
    """Record the rows of every glue pass (``runner.forward`` is only used by the glue and the jit drafter)."""
    seen: list[int] = []
    forward = spec.runner.forward

    def recording(items):
        if all(item.logits == "all" for item in items):
            seen.extend(len(item.token_ids) for item in items)
        return forward(items)

    spec.runner.forward = recording
    return seen


@pytest.mark.parametrize("temperature, branch_steps", [(0.0, None), (1.0, None), (0.0, 1), (1.0, 2)])
def test_glue_is_one_row_and_the_draft_cache_stays_exact(draft, temperature, branch_steps):
    # K = 3: a tapered tree (branch_steps < K) hits branches of different lengths
    spec = Speculator(ModelRunner(draft.model, 128, BLOCK),
                           SpecPlan.fixed([1, 1, 1, 2], branch_steps=branch_steps, deep_branches=2))
    glues = _glue_lengths(spec)
    params = SamplingParams(temperature=temperature, max_tokens=64)
    rows = spec.respond(RoundRequest([], [Admission(0, [3, 7, 1, 9, 4], params, seed=1)], [], [0])).rows
    hits = misses = 0
    for round_ in range(10):
        spec.build()
        seq, state = spec.states[0].seq, spec.states[0].draft
        tokens = seq.tokens + spec.states[0].sent
        assert state.num_cached == len(tokens)
        ref = _reference_kv(draft, tokens)
        got = spec.runner.cache.data[:, :, spec.runner.slots(state.block_table, 0, state.num_cached)]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        if round_ > 0:
            assert glues[-1] == 1, glues  # only the last drafted token was fed
        keys = [key for key in spec.cache.keys() if key[0] == 0]
        if round_ % 3 == 2:  # a miss: an outcome the cache did not prepare
            taken = {(kk, t) for _, kk, t in keys}
            bonus = next(t for t in range(48) if (0, t) not in taken and t != spec.states[0].sent[0])
            outcome = Outcome(0, 0, bonus)
        else:
            _, kk, bonus = keys[round_ % len(keys)]
            outcome = Outcome(0, kk, bonus)
        rows = spec.respond(RoundRequest([outcome], [], [], [0])).rows
        hits, misses = hits + rows[0].hit, misses + (not rows[0].hit)
    assert hits >= 5 and misses >= 3
    spec.close()


def test_draft_blocks_return_to_full(draft):
    runner = ModelRunner(draft.model, 128, BLOCK)
    spec = Speculator(runner, SpecPlan.fixed([2, 1, 1, 2]))
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    admissions = [Admission(i, [3, 7, 1, i + 2], p, seed=i) for i, p in enumerate(params)]
    spec.respond(RoundRequest([], admissions, [], [0, 1]))
    for round_ in range(6):
        spec.build()
        keys = {key[0]: key for key in spec.cache.keys()}
        outcomes = [Outcome(i, keys[i][1], keys[i][2]) if round_ % 2 else Outcome(i, 0, 47) for i in (0, 1)]
        spec.respond(RoundRequest(outcomes, [], [], [0, 1]))
    spec.build()  # scratch held until the next request
    assert runner.blocks.num_free < runner.blocks.num_blocks
    spec.respond(RoundRequest([], [], [0, 1], []))  # both sequences leave
    spec.build()
    assert runner.blocks.num_free == runner.blocks.num_blocks


def _prefill_request(seq_id: int, tokens: list[int]):
    from saguaro.ssd.protocol import CMD_PREFILL
    return RoundRequest(admissions=[Admission(seq_id, tokens, SamplingParams(), 0)], command=CMD_PREFILL)


@pytest.mark.parametrize("idle", [True, False], ids=["fed-while-idle", "fed-at-admission"])
def test_prefill_ahead_of_admission_is_kept_and_exact(draft, idle):
    """The draft cache filled during the target's prefill serves the first speculation: only the last
    prompt token and the first generated one are fed, and the cache equals a fresh prefill. A prefill is only
    taken on arrival; the idle time feeds it in pieces, or the admission feeds what is left, in one pass."""
    runner = ModelRunner(draft.model, 128, BLOCK)
    spec = Speculator(runner, SpecPlan.fixed([1, 1, 1, 2]))
    prompt = [3, 7, 1, 9, 4, 11, 2]
    spec.prefill(_prefill_request(0, prompt))
    assert spec.states[0].draft.num_cached == 0  # nothing fed between a request and what follows it
    while idle and spec.prefill_piece():
        pass
    assert spec.states[0].draft.num_cached == (len(prompt) - 1 if idle else 0)
    fed: list[int] = []
    forward = runner.forward
    runner.forward = lambda items: fed.extend(len(i.token_ids) for i in items) or forward(items)
    rows = spec.respond(RoundRequest([], [Admission(0, prompt + [5], SamplingParams(), 0)], [], [0])).rows
    expected = [2] if idle else [len(prompt) - 1, 2]  # (the rest of the prefill,) the last prompt token + the first
    assert fed[:len(expected)] == expected and len(rows[0].tokens) == 3
    state = spec.states[0].draft
    tokens = prompt + [5] + rows[0].tokens
    ref = _reference_kv(draft, tokens[:state.num_cached])
    torch.testing.assert_close(runner.cache.data[:, :, runner.slots(state.block_table, 0, state.num_cached)], ref,
                               atol=1e-5, rtol=1e-4)
    spec.respond(RoundRequest([], [], [0], []))
    assert runner.blocks.num_free == runner.blocks.num_blocks


def test_prefill_that_does_not_match_the_admission_starts_over(draft):
    runner = ModelRunner(draft.model, 128, BLOCK)
    spec = Speculator(runner, SpecPlan.fixed([1, 1, 1, 2]))
    spec.prefill(_prefill_request(0, [3, 7, 1, 9]))
    spec.prefill(_prefill_request(1, [4, 4, 4]))
    spec.respond(RoundRequest([], [Admission(0, [3, 8, 1, 9, 2], SamplingParams(), 0)], [], [0]))
    tokens = spec.states[0].seq.tokens + spec.states[0].sent
    state = spec.states[0].draft
    ref = _reference_kv(draft, tokens[:state.num_cached])
    torch.testing.assert_close(runner.cache.data[:, :, runner.slots(state.block_table, 0, state.num_cached)], ref,
                               atol=1e-5, rtol=1e-4)
    spec.respond(RoundRequest([], [], [0, 1], []))  # 1 was prefilled and never admitted
    prefilled = [i for i, s in spec.states.items() if s.prefilled is not None]
    assert runner.blocks.num_free == runner.blocks.num_blocks and not prefilled


@pytest.mark.parametrize("fallback", ["jit", "random"])  # drafted misses, point-mass misses
def test_a_speculator_round_reads_from_the_device_once_per_half(draft, fallback, monkeypatch):
    """The build reads once (the glue's ranking, which chooses the branches) and leaves the branches' tokens
    on the device; respond gathers the hits there and reads them with the misses' drafts and ranked ids:
    one read each, however many sequences hit or miss (tests/host_reads.py follows device values on the
    CPU). Greedy and sampled sequences, hits and misses, every round."""
    from tests.host_reads import counting_device_reads
    spec = Speculator(ModelRunner(draft.model, 256, BLOCK), SpecPlan.fixed([1, 1, 1, 2], miss_strategy=fallback))
    params = [SamplingParams(max_tokens=64), SamplingParams(temperature=1.0, max_tokens=64)]
    order = [0, 1, 2, 3]
    admissions = [Admission(i, [3, 7, 1, 9 + i], params[i % 2], seed=i) for i in order]
    build_reads, respond_reads, hits = [], [], []
    with counting_device_reads(monkeypatch) as reads:
        spec.respond(RoundRequest([], admissions, [], order))
        for round_ in range(5):
            before = reads.count
            spec.build()
            build_reads.append(reads.count - before)
            keys = {}
            for i, k, t in spec.cache.keys():
                keys.setdefault(i, (k, t))
            miss = {i for i in order if (i + round_) % 2}  # two hit, two miss, alternating
            taken = {(i, t) for i, k, t in spec.cache.keys() if k == 0}
            outcomes = [Outcome(i, 0, next(t for t in range(48) if (i, t) not in taken)) if i in miss
                        else Outcome(i, *keys[i]) for i in order]
            before = reads.count
            rows = spec.respond(RoundRequest(outcomes, [], [], order)).rows
            respond_reads.append(reads.count - before)
            hits.append([r.hit for r in rows])
    assert hits == [[(i + r) % 2 == 0 for i in order] for r in range(5)]
    assert build_reads == [1] * 5 and respond_reads == [1] * 5, (build_reads, respond_reads)
    spec.close()
