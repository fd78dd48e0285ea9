"""The adaptive K chooser: settings validation, the acceptance estimate, the speed model and the schedule."""
import numpy as np
import pytest

from saguaro.adapt.costs import LiveCosts
from saguaro.adapt.estimate import AcceptanceEstimate
from saguaro.adapt.schedule import AdaptiveK, Priors, SSDModel
from saguaro.engine.k_schedule import FixedK
from saguaro.adapt_settings import AdaptSettings
from saguaro.adapt.speed import BatchCosts, SSDRound, sd_gains, ssd_gains
from saguaro.config import Config
from saguaro.engine.sequence import Sequence
from saguaro.sampling.params import SamplingParams
from saguaro.theory.speedup import expected_tokens, sd_speedup


@pytest.mark.parametrize("bad, message", [
    (dict(max_k=-1), "max_k"), (dict(prior=1.5), "prior"), (dict(prior=-0.1), "prior"),
    (dict(decay=1.0), "decay"), (dict(probe_k=0), "probe_k"), (dict(probe_interval=0), "probe"),
    (dict(probe_interval=9, max_probe_interval=8), "probe"), (dict(prior_rounds=0), "prior_rounds"),
    (dict(min_gain=0), "min_gain"), (dict(stay_gain=0), "stay_gain"), (dict(stay_gain=1.1), "stay_gain"),
    (dict(explore_margin=1.0), "explore_margin"), (dict(explore_margin=-0.1), "explore_margin"),
    (dict(probe_budget=0.0), "probe_budget"), (dict(probe_budget=1.5), "probe_budget"),
    (dict(max_probe_wait=4), "max_probe_wait")])
def test_settings_out_of_range_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        AdaptSettings(**bad)
    with pytest.raises(ValueError, match=message):  # also through the engine's Config (as LLM(adapt=...) passes it)
        Config(target="t", draft="d", mode="sd", adapt=bad)


def test_estimate_starts_at_the_prior_and_follows_rounds():
    est = AcceptanceEstimate([0.8, 0.6], prior_rounds=2.0, decay=0.5)
    assert est.rates(3) == pytest.approx([0.8, 0.6, 0.6])
    assert est.expected_tokens(0) == [1.0]
    est.observe(4, 1)  # position 1 accepted, position 2 rejected, 3 and 4 never judged
    assert est.tried == [1.0, 1.0, 0.0, 0.0] and est.accepted == [1.0, 0.0, 0.0, 0.0]
    assert est.prior_weight == [1.0, 1.0, 2.0, 2.0]
    assert est.rate(0) == pytest.approx((1 + 1 * 0.8) / 2)  # the prior's 2 pseudo-rounds decayed to 1
    assert est.rate(1) == pytest.approx((0 + 1 * 0.6 * est.rate(0) / 0.8) / 2)
    for _ in range(40):  # a run of full acceptances: the estimate forgets the rejection and tends to 1
        est.observe(4, 4)
    assert all(r > 0.95 for r in est.rates(4))
    assert min(est.prior_weight) == pytest.approx(0.1)  # the prior's floor
    for _ in range(40):  # then every first draft fails: deep positions, seldom reached now, fall with it
        est.observe(4, 0)
    assert est.rate(0) < 0.05 and est.rate(3) < 0.2
    with pytest.raises(ValueError):
        est.observe(2, 3)
    with pytest.raises(ValueError):
        AcceptanceEstimate([1.2])


def test_expected_tokens_matches_thm2_for_a_constant_rate():
    est = AcceptanceEstimate([0.7])
    assert est.expected_tokens(5) == pytest.approx([expected_tokens(0.7, k) for k in range(6)])


def costs(verify_slope=0.02, draft_ratio=0.1) -> LiveCosts:
    rows = [1, 2, 4, 8, 16, 64]
    return LiveCosts({str(n): 1.0 + verify_slope * (n - 1) for n in rows},
                     {str(n): draft_ratio * (1 + 0.03 * (n - 1)) for n in rows})


def test_sd_gain_is_thm2_with_measured_costs():
    c = costs()
    est = AcceptanceEstimate([0.6])
    verify = 1.0 + 0.02 * 4
    want = sd_speedup(expected_tokens(0.6, 4), 4 * 0.1 / verify) * 1.0 / verify
    gains = sd_gains(np.array(est.expected_tokens(4)), BatchCosts.at(c, 1, 4))
    assert gains[4] == pytest.approx(want) and gains[0] == 1.0


def test_ssd_gain_hits_hide_the_draft():
    c, est = costs(draft_ratio=0.3), AcceptanceEstimate([0.6])
    always = SSDRound(p_hit=1.0, build_s=0.5, jit_misses=True, backup_acceptance=0.3)
    never = SSDRound(p_hit=0.0, build_s=0.5, jit_misses=True, backup_acceptance=0.3)
    tokens, batch = np.array(est.expected_tokens(3)), BatchCosts.at(c, 1, 3)
    sd, ssd_always = sd_gains(tokens, batch), ssd_gains(tokens, batch, always)
    ssd_never = ssd_gains(tokens, batch, never)
    assert (ssd_always[1:] > sd[1:]).all() and ssd_never == pytest.approx(sd)
    busy_bus = SSDRound(p_hit=1.0, build_s=0.5, jit_misses=True, backup_acceptance=0.3, slowdown=1.5)
    assert ssd_gains(tokens, batch, busy_bus)[1:] == pytest.approx(ssd_always[1:] / 1.5)


def seq(temperature=0.0):
    return Sequence([1, 2, 3], SamplingParams(temperature=temperature, max_tokens=100))


def chooser(prior=0.8, max_k=5, draft_ratio=0.1, **settings) -> AdaptiveK:
    return AdaptiveK(max_k, AdaptSettings(**settings), costs(draft_ratio=draft_ratio),
                     Priors([0.0], [[prior]], [0.3], [0.0]))


def test_chooser_picks_k_from_the_estimate():
    sure = chooser(prior=0.97)
    s = seq()
    assert sure.choose([s]) == [5]  # likely drafts, cheap draft: the most K
    weak = chooser(prior=0.05)
    assert weak.choose([s]) == [0]  # drafts that fail cost more than they give: AR
    assert s.spec.k_per_round == [5, 0] and s.spec.rounds_at_k0 == 1
    middle = chooser(prior=0.5)
    k = middle.choose([seq()])[0]
    gains = middle.gains([seq()], BatchCosts.at(middle.costs, 1, 5))[0].tolist()
    assert 1 <= k < 5 and gains[k] == max(gains)
    assert chooser(max_k=0).choose([seq()]) == [0]
    capped = AdaptiveK(5, AdaptSettings(max_k=2), costs(), Priors([0.0], [[0.97]], [0.3], [0.0]))
    assert capped.max_k == 2 and capped.choose([seq()]) == [2]  # the settings' cap


def test_chooser_falls_to_ar_probes_and_returns():
    # a budget that lets the intervals rule (a probe here costs a third of a round: ``test_a_probe_waits_...``)
    c = chooser(prior=0.9, draft_ratio=0.3, probe_interval=2, max_probe_interval=8, probe_budget=1.0)
    s = seq()
    assert c.choose([s])[0] > 0
    for _ in range(10):  # every first draft rejected
        c.observe(s, 5, 0)
    assert [c.choose([s])[0] for _ in range(3)] == [0, 0, 1]  # a probe of probe_k drafts after 2 rounds at 0
    c.observe(s, 1, 0)  # it fails: the interval doubles
    ks, ahead = [], []
    for _ in range(5):
        ks.append(c.choose([s])[0])
        ahead.append(c.ahead([s], ks[-1:])[0])
    assert ks == [0, 0, 0, 0, 1]
    # the round before the probe has its speculation prepared (SSD's build beside that AR step), no other
    assert ahead == [0, 0, 0, 1, 1]
    for _ in range(6):  # the text became predictable: the probe's successes bring speculation back
        c.observe(s, 1, 1)
    assert c.choose([s])[0] > 1
    assert c.states[s.seq_id].interval == 2
    c.release(s.seq_id)
    assert s.seq_id not in c.states


def test_a_probe_waits_as_long_as_its_cost_allows():
    """A probe may cost ``probe_budget`` of the rounds at K = 0 before it. In SD with a draft step at 0.3 of a
    verification and nothing accepted, a probe of one draft costs its row (0.02) and its step (0.3), less what it
    is expected to bring: at 3% it waits 10 rounds where the intervals said 2, at most ``max_probe_wait``; a
    cheap draft (0.001) leaves the intervals to rule, and so does a budget raised by speculation that paid, or a
    request that has not speculated yet."""
    def rejected(draft_ratio, **settings):
        c, s = chooser(prior=0.9, draft_ratio=draft_ratio, probe_interval=2, max_probe_interval=8, **settings), seq()
        c.choose([s])
        for _ in range(30):
            c.observe(s, 5, 0)
        return c, s

    c, s = rejected(0.3)
    cost = c.probe_cost(s, 1)
    gained = c.state(s).estimate.expected_tokens(1)[1] - 1.0
    assert cost == pytest.approx(0.02 + 0.3 - gained) and 0.28 < cost < 0.32
    wait = int(np.ceil(cost / 0.03))
    ks = [c.choose([s])[0] for _ in range(wait + 1)]
    assert ks == [0] * wait + [1] and c.states[s.seq_id].interval == wait
    c.observe(s, 1, 0)  # a failed probe: the doubled interval (4) is still shorter than the cost allows
    assert [c.choose([s])[0] for _ in range(wait + 1)] == [0] * wait + [1]
    c, s = rejected(0.3, probe_budget=0.001, max_probe_wait=40)
    assert c.choose([s]) == [0] and c.states[s.seq_id].interval == 40
    c, s = rejected(0.001)
    assert c.probe_cost(s, 1) < 0.03 and c._wait(s, 2, 1) == 2
    # in a batch a probe's cost falls on every request's round: four requests that fail alike each wait four
    # times what one probe's cost in a round of four allows, so together they spend the same budget
    c = chooser(prior=0.9, draft_ratio=0.3, probe_interval=2, max_probe_interval=8)
    batch = [seq() for _ in range(4)]
    c.choose(batch)
    for _ in range(30):
        for s in batch:
            c.observe(s, 5, 0)
    wait = int(np.ceil(4 * c.probe_cost(batch[0], 4) / 0.03))
    assert 2 * 10 < wait < 64  # at batch 1 it was 10
    rounds = [c.choose(batch) for _ in range(wait + 1)]
    assert rounds == [[0] * 4] * wait + [[1] * 4] and c.states[batch[0].seq_id].interval == wait
    # speculation that paid (15 rounds of every draft accepted) raises the budget to what it gained a round: after
    # a bad patch that same probe waits only the intervals, as the text is likely to pay again
    c, s = chooser(prior=0.9, draft_ratio=0.3, probe_interval=2, max_probe_interval=8), seq()
    for i in range(40):
        k = c.choose([s])[0]
        if k:
            c.observe(s, k, k if i < 15 else 0)
    state = c.state(s)
    assert state.advantage > 0.3 and state.speculated > 15 and c.probe_cost(s, 1) > 0.15  # 5+ rounds at 3%
    assert c._wait(s, 2, 1) == 2 and state.interval == 8  # the doubled interval, not the cost's
    # a request the prior put at K = 0 has no round of its own against speculating: it probes after the interval
    c, s = chooser(prior=0.05, draft_ratio=0.3, probe_interval=2, max_probe_interval=8), seq()
    assert [c.choose([s])[0] for _ in range(3)] == [0, 0, 1] and c.probe_cost(s, 1) > 0.2


def test_an_ssd_probe_is_priced_by_what_its_parts_add():
    """In SSD a probe's parts (the catch-up and the build beside the rounds before it) are measured at K = 0 as
    what they add to those rounds: two rounds at 1.3 plain ones add 0.6 of a round per probe, whether probes come
    every 4 rounds or every 20. Until measured, and always for a seeded request (no clock), they are two rounds
    slowed by the profile's contention; the probe's own round adds its row, less its expected tokens."""
    from saguaro.adapt.costs import ZeroRounds
    for wait in (4, 20):
        rounds = ZeroRounds()
        for i in range(40 * wait):
            parts = i % wait >= wait - 2
            rounds.observe(1.3 if parts else 1.0, parts)
            if i % wait == wait - 1:
                rounds.probed()
        assert rounds.probe_parts() == pytest.approx(0.6, rel=0.05)
    assert ZeroRounds().probe_parts() is None
    c = AdaptiveK(4, AdaptSettings(), costs(draft_ratio=0.5), Priors([0.0], [[0.1]], [0.3], [0.5]),
                  SSDModel(lambda b: True, 0.18, part_slowdown=1.25))
    s, seeded = seq(), Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=100))
    own = 0.02 - 0.1  # one row more, 0.1 of a token expected: the round itself gains
    assert c.probe_cost(s, 1) == pytest.approx(2 * 0.25) and c.probe_cost(seeded, 1) == pytest.approx(0.5)
    for i in range(400):  # measured: a fifth of a round per probe
        c.observe_round([0], 1.2 if i % 10 == 9 else 1.0, beside_parts=i % 10 == 9)
        if i % 10 == 9:
            c.zero[1].probed()
    assert c.probe_cost(s, 1) == pytest.approx(0.2, rel=0.05) and own < 0
    assert c.probe_cost(seeded, 1) == pytest.approx(0.5)  # the seeded request's stays the profile's


def test_the_engine_prices_a_probe_s_parts_from_the_one_row_contention(monkeypatch):
    """Until measured (and for a seeded request always), a probe's part is priced by the profile's contention
    probe beside one draft row, which streams the bus; the build's own slowdown stays the plan's width's."""
    from dataclasses import replace

    import saguaro.adapt.build as build
    from saguaro.calibration.profile import BusyDraft, ContentionProbe, default_profile
    from saguaro.ssd.plan import SpecPlan
    calibrated = replace(default_profile("t", "d", "bfloat16", 3), default=False)
    calibrated.timing.contention = ContentionProbe(busy=[BusyDraft(1, 1.3, 50.0), BusyDraft(8, 1.05, 10.0)], rows=4)
    monkeypatch.setattr(build, "_profile", lambda cfg: calibrated)
    cfg = Config(target="t", draft="d", mode="ssd", dtype="bfloat16", num_speculative_tokens=3)
    _, schedule = build.ssd_schedule(cfg, SpecPlan.fixed([4, 2, 1, 1]))
    assert schedule.ssd.part_slowdown == pytest.approx(1.3) and schedule.ssd.slowdown < 1.3
    seeded = Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=100))
    assert schedule.probe_cost(seeded, 1) >= 0.6 - 1e-9  # two parts at 0.3, its own round none or more


@pytest.mark.parametrize("draft_ratio, catches_up", [(0.6, True), (0.3, False)])
def test_a_request_catches_up_before_its_probe_where_the_glue_would_outlast_the_ar_step(draft_ratio, catches_up):
    """Two rounds before its probe a request at K = 0 has its draft cache fed in the speculator's idle time, if
    the build that prepares the probe, its glue of the skipped tokens and a step, would outlast the AR step
    (a draft step 0.6 of a verification: 0.67 + 0.6 > 1); a cheap draft (0.3: 0.34 + 0.3) glues them there."""
    c, s = chooser(prior=0.9, draft_ratio=draft_ratio, probe_interval=4, max_probe_interval=4, probe_budget=1.0), seq()
    c.choose([s])
    for _ in range(10):
        c.observe(s, 5, 0)
    ks, catch_up = [], []
    for _ in range(6):
        ks.append(c.choose([s])[0])
        catch_up.append(c.catch_up([s], ks[-1:]))
    assert ks == [0, 0, 0, 0, 1, 0]
    assert catch_up == [[], [], [s.seq_id] if catches_up else [], [], [], []]


def test_a_speculating_request_stays_until_its_gain_falls_below_stay_gain():
    """Between ``stay_gain`` and ``min_gain``, a request that speculates keeps on (at K = 0 it would learn nothing)
    and one at K = 0 does not start; below ``stay_gain`` it stops."""
    c, s = chooser(prior=0.9, draft_ratio=0.3, probe_interval=64, max_probe_interval=64), seq()
    gains = c.gains([s], BatchCosts.at(c.costs, 1, 5))[0]
    c.settings = AdaptSettings(min_gain=gains[1:].max() + 0.01, stay_gain=gains[1:].max() - 0.01,
                               probe_interval=64, max_probe_interval=64)
    assert c.choose([s])[0] == 0  # not started: below min_gain
    s.spec.k_per_round[-1] = 1  # as if its last round had speculated
    assert c.choose([s])[0] == 1 + int(np.argmax(gains[1:]))  # above stay_gain: it stays
    c.settings = AdaptSettings(min_gain=gains[1:].max() + 0.02, stay_gain=gains[1:].max() + 0.01,
                               probe_interval=64, max_probe_interval=64)
    assert c.choose([s])[0] == 0  # below stay_gain: it stops
    assert c.choose([s])[0] == 0  # and at K = 0 it needs min_gain again


def test_k_zero_is_priced_as_its_rounds_run():
    """In SSD a round at K = 0 can run beside a probe's catch-up or build: one round in four taking twice a plain
    one prices K = 0 at 0.8, and a request predicted below ``min_gain`` but above 0.8 of it speculates. What every
    round pays (here 3 AR steps' price: a tiny model's post to the speculator) is not K = 0's; rounds that verified
    a draft are not K = 0's either; a seeded request, whose choice reads no clock, still needs ``min_gain``."""
    c = chooser(prior=0.9, draft_ratio=0.3, probe_interval=64, max_probe_interval=64)
    best = c.gains([seq()], BatchCosts.at(c.costs, 1, 5))[0][1:].max()
    c.settings = AdaptSettings(min_gain=best + 0.05, stay_gain=best, probe_interval=64, max_probe_interval=64)
    waiting = seq()
    assert c.choose([waiting]) == [0] and waiting.spec.gain_per_round == [1.0]
    plain = 3 * c.costs.verify(1)
    for i in range(60):
        c.observe_round([0], plain)
        c.observe_round([0, 2], 10.0)  # a round that speculated: its time is not K = 0's
    assert c.zero_gain(1) == 1.0 and 2 not in c.zero
    for i in range(400):
        c.observe_round([0], 2 * plain if i % 4 == 3 else plain, beside_parts=i % 4 == 3)
    assert 0.77 < c.zero_gain(1) < 0.83
    s, seeded = seq(), Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=100))
    assert c.choose([s])[0] == 1 + int(np.argmax(c.gains([s], BatchCosts.at(c.costs, 1, 5))[0][1:]))
    assert s.spec.gain_per_round[0] == pytest.approx(best)
    assert c.choose([seeded]) == [0] and seeded.spec.gain_per_round == [1.0]


def test_a_position_the_request_has_not_tried_is_tried_when_its_gain_is_close():
    """A request at K = 1 never drafts position 2, so its rate there stays the prior's guess: when K = 2 is
    predicted within ``explore_margin`` of the best, K = 2 is tried; once tried, the estimate decides again."""
    def at_k1(margin):
        c, s = chooser(prior=0.9, draft_ratio=0.3, explore_margin=margin), seq()
        state = c.state(s)
        state.estimate.prior = [0.95, 0.3]  # a guess at position 2 that makes K = 1 the best
        state.estimate.known.clear()
        for _ in range(6):
            c.observe(s, 1, 1)
        gains = c.gains([s], BatchCosts.at(c.costs, 1, 5))[0]
        return c, s, gains

    c, s, gains = at_k1(0.0)
    assert 1 + int(np.argmax(gains[1:])) == 1 and c.choose([s]) == [1]  # no exploring: K = 1 for ever
    margin = 1.0 - gains[2] / gains[1] + 0.01  # K = 2 just within the margin
    c, s, _ = at_k1(margin)
    assert c.choose([s]) == [2]  # position 2 is tried
    c.observe(s, 2, 2)
    assert c.state(s).estimate.tried_at(1) >= 0.5 and c.choose([s])[0] in (1, 2)  # then the estimate decides
    c, s, _ = at_k1(max(margin - 0.02, 0.0))
    assert c.choose([s]) == [1]  # outside the margin: not tried


def test_choices_depend_only_on_what_was_observed():
    """The same verified outcomes give the same K's (no clock, no randomness in the choice given the costs)."""
    runs = []
    for _ in range(2):
        c, s = chooser(prior=0.7, probe_interval=1, max_probe_interval=4), seq(1.0)
        ks = []
        for kept in [3, 0, 0, 1, 0, 0, 0, 0, 5, 5, 2]:
            k = c.choose([s])[0]
            ks.append(k)
            c.observe(s, k, min(kept, k))
        runs.append(ks)
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_ssd_chooser_uses_the_hit_rate():
    def ssd(p_hit):
        return AdaptiveK(4, AdaptSettings(), costs(draft_ratio=0.5),
                         Priors([0.0], [[0.45]], [0.3], [p_hit]), SSDModel(lambda b: True, 0.18))
    def at_k4(c):
        return c.gains([seq()], BatchCosts.at(c.costs, 1, 4))[0, 4]
    assert at_k4(ssd(1.0)) > at_k4(ssd(0.0))
    c, s = ssd(0.5), seq()
    c.observe(s, 4, 2, hit=True)
    assert c.states[s.seq_id].hit_rate.rate(0) > 0.5
    c.ssd.slowdown = 2.0
    c.observe_verify(5, 0.0216, beside_build=True)  # the table keeps the verification alone
    assert c.costs.verify(5) == pytest.approx(0.0108)


def test_a_skipped_miss_counts_as_a_miss_and_its_one_token_against_its_price():
    """Miss strategy "skip" answers a miss with an empty row: the round asked drafts and drafted none. Its miss
    moves the hit rate and its one token what speculating gave this request; a round at K = 0 (no hit flag)
    moves neither."""
    c = AdaptiveK(4, AdaptSettings(), costs(draft_ratio=0.5), Priors([0.0], [[0.6]], [0.0], [0.5]),
                  SSDModel(lambda b: False, 0.18))
    s = seq()
    c.choose([s])
    assert s.spec.k_per_round[-1] > 0
    before = c.states[s.seq_id].hit_rate.rate(0)
    c.observe(s, 0, 0, hit=False)  # asked, skipped
    state = c.states[s.seq_id]
    assert state.hit_rate.rate(0) < before and state.speculated == 1 and state.advantage < 0
    rate = state.hit_rate.rate(0)
    c.observe(s, 0, 0, hit=None)  # an AR step
    assert state.hit_rate.rate(0) == rate and state.speculated == 1


def test_a_speculating_round_is_priced_with_the_answer_it_waits_for():
    """What rounds at a batch size waited for the speculator's answer after their verification is added to every
    speculating round's price there (Cor. 17's latency + T_w), and only there; a seeded request, whose choice
    reads no clock, leaves it out."""
    def ssd():
        return AdaptiveK(4, AdaptSettings(), costs(draft_ratio=0.3), Priors([0.0], [[0.6]], [0.3], [0.8]),
                         SSDModel(lambda b: True, 0.05))
    c, fresh = ssd(), ssd()
    s, seeded = seq(), Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=100))
    batch = BatchCosts.at(c.costs, 2, 4)
    tokens = np.array(c.state(s).estimate.expected_tokens(4))
    plain = SSDRound(0.8, c.costs.build_s(4, 0.05), True, 0.3)  # the prior's hit rate, the prior's build
    before = c.gains([s], batch)[0]
    assert before == pytest.approx(ssd_gains(tokens, batch, plain))
    c.observe_answer(2, 0.4)
    c.observe_answer(2, 0.4)
    assert c.answer_s(2) == pytest.approx(0.4) and c.answer_s(1) == 0.0
    after = c.gains([s], batch)[0]
    assert after == pytest.approx(ssd_gains(tokens, batch, SSDRound(0.8, c.costs.build_s(4, 0.05), True, 0.3,
                                                                     answer_s=0.4)))
    assert (after[1:] < before[1:]).all() and after[0] == before[0] == 1.0
    at_one = BatchCosts.at(c.costs, 1, 4)
    assert c.gains([s], at_one)[0] == pytest.approx(fresh.gains([s], at_one)[0])  # none timed at batch 1
    assert c._reproducible_gains([seeded]) == pytest.approx(fresh._reproducible_gains([seeded]))


def test_an_ssd_build_that_outlasts_the_verification_prices_deep_k():
    """A build at K makes K + 1 passes: where each pass costs a third of a verification, K = 5 keeps the round
    waiting on the build (6 passes, two verifications long) and a shorter K wins, though every hit carries K tokens;
    with passes ten times cheaper the deepest K wins. Measured builds, at whatever K they ran, set the pass."""
    def best_k(pass_s):
        c = AdaptiveK(5, AdaptSettings(), costs(draft_ratio=0.1), Priors([0.0], [[0.7]], [0.3], [0.9]),
                      SSDModel(lambda b: True, pass_s))
        return int(np.argmax(c.gains([seq()], BatchCosts.at(c.costs, 1, 5))[0])), c
    slow, c = best_k(1.0 / 3)
    fast, _ = best_k(1.0 / 30)
    assert fast == 5 and 1 <= slow < 4
    c.observe_build(0.1, 2)  # a measured build of two steps: passes as cheap as the fast prior's
    assert int(np.argmax(c.gains([seq()], BatchCosts.at(c.costs, 1, 5))[0])) == 5


def test_a_batch_is_judged_row_by_row():
    """The batch's one array computation gives each sequence the gains it gets on its own (same round costs)."""
    c = AdaptiveK(4, AdaptSettings(), costs(draft_ratio=0.4), Priors([0.0, 1.0], [[0.5], [0.8]], [0.3, 0.2],
                                                                  [0.4, 0.7]), SSDModel(lambda b: False, 0.18, 1.3))
    seqs = [seq(), seq(1.0), seq()]
    c.observe(seqs[2], 4, 4, hit=True)
    batch = BatchCosts.at(c.costs, 3, 4)
    together = c.gains(seqs, batch)
    assert together.shape == (3, 5)
    for s, row in zip(seqs, together):
        assert row == pytest.approx(c.gains([s], batch)[0])
    assert len({tuple(r) for r in together.round(6)}) == 3


def test_a_seeded_request_chooses_from_its_own_rounds_only():
    """Its K sequence does not depend on the clock or the batch: the same outcomes give the same K's."""
    def run(batch_size, verify_s):
        c = chooser(prior=0.6, draft_ratio=0.3, probe_interval=1, max_probe_interval=2)
        s = Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=100))
        others = [seq() for _ in range(batch_size - 1)]
        ks = []
        for kept in [2, 0, 0, 0, 1, 3, 0, 4, 4, 0]:
            c.observe_verify(3, verify_s)  # the machine's measured speed differs between the runs
            k = c.choose([s] + others)[0]
            ks.append(k)
            c.observe(s, k, min(k, kept))
        return ks
    alone = run(1, 0.01)
    assert alone == run(8, 0.5) and len(set(alone)) > 1


def test_live_costs_follow_the_rounds():
    c = costs()
    c.observe_verify(5, 0.0108)  # the first timing sets the (relative) tables' level in seconds, shape kept
    assert c.verify(5) == pytest.approx(0.0108) and c.verify(1) == pytest.approx(0.01)
    assert c.draft_step(1) == pytest.approx(0.001)  # the draft's with it, until it is timed itself
    c.observe_draft(1, 4, 0.008)
    assert c.draft_step(1) == pytest.approx(0.002) and c.verify(1) == pytest.approx(0.01)
    for _ in range(40):  # the machine got three times slower: the level follows, the shape stays
        c.observe_verify(5, 0.0324)
        c.observe_verify(1, 0.03)
    assert c.verify(5) == pytest.approx(0.0324, rel=1e-3) and c.verify(1) == pytest.approx(0.03, rel=1e-3)
    shape = c.verify(5) / c.verify(1)
    c.observe_verify(2, 10.0)  # one pass in a burst of load moves the level a step, and no row count's share of it
    assert c.verify(5) / c.verify(1) == pytest.approx(shape) and c.verify(1) > 0.03
    c.observe_build(0.5, 4)  # K = 4: the glue and four steps, 0.1 s a pass
    c.observe_build(0.6, 2)
    assert 0.1 < c.build_pass_s < 0.2
    assert c.build_s(4, 1.0) == pytest.approx(c.build_pass_s * np.arange(1, 6))  # the measured pass, not the prior


def test_the_verification_s_shape_is_the_table_s_whatever_a_row_count_was_timed_in():
    """An int4 target's table (6 rows cost 2.5 times 1 row) against the default's 2% a row: the table's shape sets
    how far a request accepting half its drafts speculates. AR steps timed in a burst of load (2.5x), then a
    machine that got slower while only AR steps ran, move the level; a request speculating at 3 rows after them
    prices its AR step from the table, not from what one row count's timings absorbed."""
    c = costs(verify_slope=0.3)

    def true(n, load=1.0):
        return load * 0.045 * (1 + 0.3 * (n - 1))
    tokens = np.array([[expected_tokens(0.5, k) for k in range(6)]])
    flat = sd_gains(tokens, BatchCosts.at(costs(), 1, 5))
    steep = sd_gains(tokens, BatchCosts.at(c, 1, 5))
    assert int(np.argmax(steep)) < int(np.argmax(flat))
    for _ in range(10):
        c.observe_verify(1, true(1))
        c.observe_verify(3, true(3))
    for _ in range(4):
        c.observe_verify(1, true(1, load=2.5))
    for _ in range(30):
        c.observe_verify(3, true(3))
    assert c.verify(3) == pytest.approx(true(3), rel=0.01) and c.verify(1) == pytest.approx(true(1), rel=0.01)
    for _ in range(20):  # slower while only AR steps ran: then speculating, the level follows and the AR step with it
        c.observe_verify(1, true(1, load=1.5))
    for _ in range(30):
        c.observe_verify(3, true(3, load=1.5))
    assert c.verify(1) == pytest.approx(true(1, load=1.5), rel=0.01)


def test_fixed_k_records_its_rounds():
    s = seq()
    assert FixedK(3).choose([s, seq()]) == [3, 3]
    assert s.spec.k_per_round == [3]
    with pytest.raises(ValueError, match="max K"):
        FixedK(-1)


def test_a_start_that_on_the_spot_drafting_would_not_pay_is_built_beside_an_ar_step_first():
    """SSD: a request that did not speculate last round and would gain from speculating, but not from a
    speculation drafted on the spot after the verification (priced as an SD round), asks K = 0 once while its
    speculation is built beside that AR step (``ahead``), then asks it of the cache. Where drafting on the spot
    pays, or a free backup drafts what the cache lacks, it starts at once."""
    def ssd(draft_ratio, jit=True):
        return AdaptiveK(4, AdaptSettings(), costs(draft_ratio=draft_ratio), Priors([0.0], [[0.6]], [0.3], [1.0]),
                         SSDModel(lambda b: jit, 0.05))

    dear, s = ssd(0.6), seq()
    tokens = np.array(dear.state(s).estimate.expected_tokens(4))
    assert sd_gains(tokens, BatchCosts.at(dear.costs, 1, 4))[1:].max() < 1.0  # SD would not pay here
    best = int(np.argmax(dear.gains([s], BatchCosts.at(dear.costs, 1, 4))[0]))
    assert best > 0  # and SSD's hits would
    first = dear.choose([s])
    assert first == [0] and dear.ahead([s], first) == [best]  # the AR step's build prepares it
    assert dear.choose([s]) == [best] and dear.states[s.seq_id].start == 0
    for _ in range(3):  # it goes on speculating from its builds
        dear.observe(s, best, best)
        assert dear.choose([s])[0] > 0

    cheap, backup = ssd(0.1), ssd(0.6, jit=False)
    for c in (cheap, backup):
        assert c.choose([seq()])[0] > 0
    # a request at K = 0 whose text becomes predictable returns the same way: built beside an AR step first
    weak = AdaptiveK(4, AdaptSettings(), costs(draft_ratio=0.6), Priors([0.0], [[0.0]], [0.3], [1.0]),
                     SSDModel(lambda b: True, 0.05))
    r = seq()
    assert weak.choose([r]) == [0] and weak.ahead([r], [0]) == [0]
    state = weak.states[r.seq_id]
    for _ in range(3):
        weak.observe(r, 4, 4)
    assert weak.choose([r]) == [0] and weak.ahead([r], [0]) == [state.start] and state.start > 0
    assert weak.choose([r])[0] > 0
