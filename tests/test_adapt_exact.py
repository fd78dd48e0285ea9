"""Adaptive K stays exact: greedy SD and SSD equal AR token for token while K changes mid-request (scripted
schedules and the adaptive one), fp32; a request that drops to K = 0 and comes back loses nothing, costs the
speculator no build meanwhile, and leaks no KV block."""
from types import SimpleNamespace

import pytest

from saguaro import LLM, SamplingParams
from saguaro.adapt.schedule import AdaptiveK
from saguaro.engine.k_schedule import KSchedule
from saguaro.adapt_settings import AdaptSettings
from saguaro.engine.model_runner import ModelRunner
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import CMD_PREFILL, Admission, Outcome, RoundRequest
from saguaro.ssd.speculator import Speculator
from tests.tiny import PROMPTS, greedy_tokens

TOKENS = 24


class Scripted(KSchedule):
    """K from a script, by each sequence's round (offset by its id, so a batch mixes K's in one verification)."""

    def __init__(self, max_k: int, script: list[int]):
        super().__init__(max_k)
        self.script = script
        self.rounds: dict[int, int] = {}

    def _choose(self, seqs):
        ks = []
        for s in seqs:
            r = self.rounds[s.seq_id] = self.rounds.get(s.seq_id, -1) + 1
            ks.append(self.script[(r + s.seq_id) % len(self.script)])
        return ks


SCRIPTS = {"switching": [3, 0, 1, 0, 0, 2, 3, 3], "ar-then-back": [0, 0, 0, 0, 3, 3, 0, 2]}


@pytest.fixture(scope="module")
def ar_outputs(pair):
    return greedy_tokens(pair[0], PROMPTS, TOKENS)


def _no_leaks(llm):
    target = llm.engine.target.blocks
    assert target.num_free == target.num_blocks
    proposer = getattr(llm.engine.decoder, "proposer", None)
    if proposer is not None:
        assert proposer.runner.blocks.num_free == proposer.runner.blocks.num_blocks


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_sd_scripted_k_equals_ar(pair, ar_outputs, script):
    llm = LLM(target=pair[0], draft=pair[1], mode="sd", num_speculative_tokens=3, block_size=4)
    llm.engine.decoder.schedule = Scripted(3, SCRIPTS[script])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))
    assert [o.token_ids for o in outs] == ar_outputs
    assert all(0 in o.spec_counts.k_per_round and 3 in o.spec_counts.k_per_round for o in outs)
    assert sum(o.spec_counts.rounds_at_k0 for o in outs) > 0
    _no_leaks(llm)


@pytest.mark.parametrize("transport", ["thread", "process"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_ssd_scripted_k_equals_ar(pair, ar_outputs, script, transport):
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, block_size=4,
             fan_out=[2, 2, 2, 4], speculator_transport=transport) as llm:
        decoder = llm.engine.decoder
        decoder.schedule = Scripted(3, SCRIPTS[script])
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))
        assert decoder.failure is None
    assert [o.token_ids for o in outs] == ar_outputs
    ks = [k for o in outs for k in o.spec_counts.k_per_round]
    assert 0 in ks and 3 in ks
    _no_leaks(llm)


@pytest.mark.parametrize("mode, transport", [("sd", "thread"), ("ssd", "thread"), ("ssd", "process")])
def test_adaptive_k_changes_mid_request_and_equals_ar(pair, ar_outputs, mode, transport):
    """The adaptive default with settings that make it move: a weak draft drives requests to K = 0, probes
    bring them back for a round (SSD: their speculation built beside the AR step before, their draft cache fed
    in the speculator's idle time a round before that), and the output is AR's."""
    adapt = AdaptSettings(prior=0.9, probe_interval=2, max_probe_interval=4, probe_budget=1.0)
    prepared, caught_up, parts, beside = [], [], [], []
    with LLM(target=pair[0], draft=pair[1], mode=mode, num_speculative_tokens=3, block_size=4, adapt=adapt,
             speculator_transport=transport) as llm:
        decoder = llm.engine.decoder
        link = getattr(decoder, "link", None)
        for name in ("post", "exchange") if mode == "ssd" else ():
            def sent(request, send=getattr(link, name)):
                if request.command != CMD_PREFILL:
                    prepared.append(request.prepare is not None)
                    caught_up.append(bool(request.catch_up))
                    # whether the speculator works beside the next verification: a build or a catch-up
                    parts.append(any(request.prepare if request.prepare is not None else request.ks)
                                 or bool(request.catch_up))
                return send(request)
            setattr(link, name, sent)
        if mode == "ssd":
            # every probe catches up: whether its glue would outlast the verification is this machine's timing
            schedule = decoder.schedule
            dear = SimpleNamespace(verify=schedule.costs.verify, draft_step=lambda rows: 1.0)
            schedule.catch_up = lambda seqs, ks: AdaptiveK.catch_up(
                SimpleNamespace(states=schedule.states, costs=dear), seqs, ks)
            observe_round = decoder.schedule.observe_round
            decoder.schedule.observe_round = lambda ks, s, b: beside.append(b) or observe_round(ks, s, b)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))
        assert getattr(decoder, "failure", None) is None
    assert [o.token_ids for o in outs] == ar_outputs
    assert any(prepared) == any(caught_up) == (mode == "ssd")
    assert beside == ([False] + parts[:-1] if mode == "ssd" else [])  # what the request before each round set going
    ks = [o.spec_counts.k_per_round for o in outs]
    assert any(len(set(k)) > 1 for k in ks), ks
    assert any(0 in k and k.index(0) < len(k) - 1 and max(k[k.index(0):]) > 0 for k in ks), ks  # 0, then back
    assert all(len(o.spec_counts.acceptance_estimate) == 3 for o in outs)
    assert all(len(o.spec_counts.gain_per_round) == len(o.spec_counts.k_per_round) for o in outs)
    _no_leaks(llm)


def _counted_speculator(draft):
    """A speculator over ``draft`` (plan K = 3) and the list of each draft pass's row count, as it runs."""
    runner = ModelRunner(draft.model, 128, 4)
    spec = Speculator(runner, SpecPlan.fixed([2, 1, 1, 2]))
    fed: list[int] = []
    forward = runner.forward
    runner.forward = lambda items: fed.extend(len(i.token_ids) for i in items) or forward(items)
    return runner, spec, fed


def test_speculator_answers_k_zero_without_drafting_or_building(pair):
    """K = 0: an empty answer, no just-in-time draft, no build; back at K = 3 the draft catches up on the tokens
    it skipped; a build is as deep as the K last asked; every block comes back at release."""
    runner, spec, fed = _counted_speculator(pair[1])
    prompt = [3, 7, 1, 9]
    rows = spec.respond(RoundRequest([], [Admission(0, prompt, SamplingParams(), 0)], [], [0], ks=[0])).rows
    assert rows[0].tokens == [] and fed == []
    assert spec.build().steps == 0 and fed == []
    bonus = 5
    for _ in range(3):  # AR steps: the target's token each round, nothing drafted
        rows = spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[0])).rows
        assert rows[0].tokens == [] and spec.build().steps == 0
    assert fed == [] and spec.states[0].seq.tokens == prompt + [bonus] * 3
    rows = spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[3])).rows
    assert len(rows[0].tokens) == 3 and fed[0] == len(prompt) + 4  # the catch-up: one pass over what it skipped
    assert spec.build().steps == 3
    key = next(iter(spec.cache.keys()))
    rows = spec.respond(RoundRequest([Outcome(0, key[1], key[2])], [], [], [0], ks=[1])).rows
    assert rows[0].hit and len(rows[0].tokens) == 1  # a hit, cut to this round's K
    assert spec.build().steps == 1  # and the build goes as deep as the K last asked, not the plan's 3
    key = next(k for k in spec.cache.keys() if k[1] == 1)
    rows = spec.respond(RoundRequest([Outcome(0, key[1], key[2])], [], [], [0], ks=[3])).rows
    assert rows[0].hit and len(rows[0].tokens) == 1  # asked for 3, a hit carries the step made
    assert spec.build().steps == 3
    spec.respond(RoundRequest([], [], [0], []))
    spec.build()
    assert runner.blocks.num_free == runner.blocks.num_blocks


def test_a_probe_s_speculation_is_built_beside_the_ar_step_before_it(pair):
    """A round at K = 0 whose next round probes (``RoundRequest.prepare``): the build beside it catches the draft
    up and prepares the probe for the AR step's outcome (its fork at depth 0), so the probe is a hit at once
    with the drafts asked; where nothing is prepared, no build."""
    runner, spec, fed = _counted_speculator(pair[1])
    prompt, bonus = [3, 7, 1, 9], 5
    spec.respond(RoundRequest([], [Admission(0, prompt, SamplingParams(), 0)], [], [0], ks=[0]))
    assert spec.build().steps == 0
    for _ in range(2):  # AR steps, nothing prepared
        spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[0], prepare=[0]))
        assert spec.build().steps == 0 and fed == []
    rows = spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[0], prepare=[1])).rows
    assert rows[0].tokens == []  # this round is still an AR step
    assert spec.build().steps == 1 and fed[0] == len(prompt) + 3  # the catch-up, in the build
    keys = set(spec.cache.keys())
    assert keys and all(k[1] == 0 for k in keys)  # every branch guesses the AR step's token
    _, _, guessed = next(iter(keys))
    fed.clear()
    rows = spec.respond(RoundRequest([Outcome(0, 0, guessed)], [], [], [0], ks=[1])).rows
    assert rows[0].hit and len(rows[0].tokens) == 1 and fed == []  # the probe: a hit, nothing drafted now
    spec.respond(RoundRequest([], [], [0], []))
    spec.build()
    assert runner.blocks.num_free == runner.blocks.num_blocks


def test_a_new_request_s_first_speculation_is_built_beside_its_first_ar_step(pair):
    """A start (``AdaptiveK._pays_unbuilt``): a request admitted at K = 0 with ``prepare`` = 3 gets an empty row,
    the build beside its first AR step prepares three drafts for that step's outcome, and its next round asks
    them: a hit with the three drafts, nothing drafted then."""
    runner, spec, fed = _counted_speculator(pair[1])
    prompt = [3, 7, 1, 9]
    rows = spec.respond(RoundRequest([], [Admission(0, prompt, SamplingParams(), 0)], [], [0], ks=[0],
                                     prepare=[3])).rows
    assert rows[0].tokens == [] and fed == []  # no draft on the spot
    assert spec.build().steps == 3
    keys = set(spec.cache.keys())
    assert keys and all(k[1] == 0 for k in keys)  # every branch guesses the AR step's token
    _, _, guessed = next(iter(keys))
    fed.clear()
    rows = spec.respond(RoundRequest([Outcome(0, 0, guessed)], [], [], [0], ks=[3])).rows
    assert rows[0].hit and len(rows[0].tokens) == 3 and fed == []
    spec.respond(RoundRequest([], [], [0], []))
    spec.build()
    assert runner.blocks.num_free == runner.blocks.num_blocks


def test_a_k_zero_sequence_catches_up_in_idle_time_before_its_probe(pair):
    """``RoundRequest.catch_up``: the draft cache of a sequence at K = 0 takes its verified tokens as idle-time
    work (no build); the build that prepares its probe a round later then feeds two tokens, not all it skipped,
    and the probe's speculation is the one a speculator that never caught up answers."""
    prompt, bonus, answers = [3, 7, 1, 9], 5, []
    for catch_up in ([0], []):
        runner, spec, fed = _counted_speculator(pair[1])
        spec.respond(RoundRequest([], [Admission(0, prompt, SamplingParams(), 0)], [], [0], ks=[0]))
        for _ in range(3):  # AR steps
            spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[0]))
            spec.build()
        spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[0], catch_up=catch_up))
        assert spec.build().steps == 0 and fed == []  # queued only: fed in idle time
        while spec.prefill_piece():
            pass
        cached = spec.states[0].draft.num_cached
        assert cached == (len(prompt) + 3 if catch_up else 0)  # every verified token but the last
        fed.clear()
        spec.respond(RoundRequest([Outcome(0, 0, bonus)], [], [], [0], ks=[0], prepare=[1]))
        assert spec.build().steps == 1
        assert fed[0] == (2 if catch_up else len(prompt) + 5)  # the glue: the last two tokens, or all of them
        _, _, guessed = next(iter(spec.cache.keys()))
        rows = spec.respond(RoundRequest([Outcome(0, 0, guessed)], [], [], [0], ks=[1])).rows
        assert rows[0].hit
        answers.append((guessed, rows[0].tokens))
        spec.respond(RoundRequest([], [], [0], []))
        spec.build()
        assert runner.blocks.num_free == runner.blocks.num_blocks  # the catch-up's blocks come back too
    assert answers[0] == answers[1]


@pytest.mark.parametrize("transport", ["thread", "process"])
def test_ssd_rounds_at_k_zero_cost_no_build_and_no_wait(pair, ar_outputs, transport):
    """A round whose every K is 0 is posted to the speculator, which applies it and builds nothing; the verifier
    does not wait for its (empty) answer. When K comes back the speculator has followed every AR step."""
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, block_size=4,
             fan_out=[2, 2, 2, 4], speculator_transport=transport, miss_strategy="jit") as llm:  # K drafts asked, K got
        decoder = llm.engine.decoder
        calls = {"post": 0, "exchange": 0}
        for name in calls:
            def counted(request, send=getattr(decoder.link, name), name=name):
                calls[name] += request.command != CMD_PREFILL
                return send(request)
            setattr(decoder.link, name, counted)
        decoder.schedule = Scripted(3, [0])
        outs = llm.generate(PROMPTS[1], SamplingParams(max_tokens=TOKENS))
        trace = list(decoder.trace)
        assert calls == {"post": len(trace), "exchange": 0}
        decoder.schedule = Scripted(3, [0, 0, 0, 3])  # quiet rounds, then one that waits for a speculation
        timed = []  # what the schedule is told of each round: the Ks it verified, its time, what ran beside it
        decoder.schedule.observe_round = lambda ks, seconds, beside: timed.append((ks, seconds, beside))
        answers = []  # and of each answer it waited for (a round that asked for a speculation)
        decoder.schedule.observe_answer = lambda batch, seconds, depth: answers.append((batch, seconds))
        start = len(decoder.trace)
        again = llm.generate(PROMPTS[1], SamplingParams(max_tokens=TOKENS))
        assert calls["exchange"] > 0 and decoder.failure is None
        rounds, chosen = decoder.trace[start:], again[0].spec_counts.k_per_round
        assert [s for _, s, _ in timed] == pytest.approx([t.verify_s + t.wait_s for t in rounds], abs=1e-3)
        verified = [ks for ks, _, _ in timed if ks]  # the first round admits the request: it verifies nothing
        assert len(verified) == len(chosen) - 1 and verified == [[k] for k in chosen[:-1]]
        # a verification runs beside the build the round before asked for (its K > 0)
        assert [b for _, _, b in timed] == [False] + [k > 0 for k in chosen[:-1]]
        waited = [t.wait_s for t, k in zip(rounds, chosen) if k]
        assert [s for _, s in answers] == pytest.approx(waited) and {b for b, _ in answers} == {1} and waited
    assert outs[0].token_ids == ar_outputs[1] == again[0].token_ids
    assert all(t.build_steps == 0 for t in trace)
    assert 3 in again[0].spec_counts.k_per_round and again[0].spec_counts.drafted > 0


def test_sd_times_no_draft_step_that_first_catches_up_on_skipped_tokens(pair):
    """After rounds at K = 0 the draft feeds the tokens it skipped before drafting: that round's proposal is a
    prefill, and timing it as K steps made the draft look dear enough to keep every later request at K = 0."""
    llm = LLM(target=pair[0], draft=pair[1], mode="sd", num_speculative_tokens=3, block_size=4)
    decoder, proposer = llm.engine.decoder, llm.engine.decoder.proposer
    decoder.schedule = Scripted(3, [0, 0, 3, 3, 3])
    rounds = []  # per round: [backlog before it, drafts asked, draft steps timed]
    decode, propose, observe = decoder.decode, proposer.propose, decoder.schedule.observe_draft

    def drafting(seqs, num_tokens, read=True):
        rounds[-1][1] = max(num_tokens)
        return propose(seqs, num_tokens, read)

    def timing(rows, steps, seconds):
        rounds[-1][2] = steps
        observe(rows, steps, seconds)

    decoder.decode = lambda seqs: rounds.append([proposer.backlog(seqs[0]), 0, 0]) or decode(seqs)
    proposer.propose, decoder.schedule.observe_draft = drafting, timing
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16))
    caught_up = [r for r in rounds if r[0] > 1 and r[1]]  # drafted after rounds at K = 0
    assert caught_up and all(r[2] == 0 for r in caught_up)  # not timed
    assert any(r[0] <= 1 and r[1] and r[2] for r in rounds)  # a plain drafting round is
