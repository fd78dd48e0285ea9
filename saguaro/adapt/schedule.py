"""The adaptive K chooser (``AdaptiveK``): each request's K for the coming round, chosen online from what was
verified before it (the seam it fills, ``KSchedule``, is ``saguaro.engine.k_schedule``'s)."""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from saguaro.adapt.costs import LiveCosts, ZeroRounds, average
from saguaro.adapt.depth import batch_depth
from saguaro.adapt.estimate import AcceptanceEstimate
from saguaro.adapt.state import Priors, RequestState, SSDModel, is_seeded, was_speculating
from saguaro.adapt_settings import AdaptSettings
from saguaro.adapt.speed import BatchCosts, SSDRound, sd_gains, ssd_gains
from saguaro.adapt.tree_choice import branches_at
from saguaro.engine.k_schedule import KSchedule
from saguaro.engine.sequence import Sequence


EXPLORE_TRIED = 0.5  # decayed trials below which a draft position's rate is still mostly the prior's
TREE_INTERVAL = 8  # rounds between two scorings of every cache tree (the same batch); the chosen one every round


def _column(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=float)[:, None]


class AdaptiveK(KSchedule):
    """Per request: a running acceptance estimate by position (``AcceptanceEstimate``, prior from the profile),
    and each round the K in 0..max with the best predicted speedup (``speed.py``: Thm 2 with the live pass
    costs). Speculation must be predicted to beat AR by ``settings.min_gain`` to start, and a request that
    speculates stops only below ``settings.stay_gain`` (at K = 0 it learns nothing); a request at K = 0 probes with
    ``probe_k`` drafts every ``interval`` rounds (doubling while probes do not pay), so it returns to
    speculation when its text becomes predictable; never sooner than keeps the probe's cost (``probe_cost``) to
    ``settings.probe_budget`` of the rounds it waits. In SSD a request that starts to speculate (new, or back from
    K = 0) where drafting its speculation on the spot would not pay takes one AR step first, beside which its
    speculation is built (``_pays_unbuilt``, ``ahead``).

    In SSD a round at K = 0 is not quite an AR step: the probes it waits for have parts beside the rounds before
    them (the catch-up of the draft cache in the speculator's idle time, the probe's build) that share the memory
    bus with the verification and are waited for. So K = 0 is priced as it runs: the mean time of the rounds
    that verified every request at K = 0 over that of the plain ones among them, per batch size (``zero``,
    ``costs.ZeroRounds``), and its inverse is K = 0's gain (at most 1), against which ``min_gain`` and
    ``stay_gain`` are read. With an int4 pair on avx2 (chat, T = 0) a round beside a probe's catch-up took 1.25
    AR steps and one beside its build 1.4; priced at 1, K = 0 had held requests at 0.9x AR where speculating at
    K = 1, predicted at 0.93, gave 0.99. A speculating round also waits after its verification for the
    speculator's answer (the outcomes taken in, a speculation drafted on the spot where none was built), which
    the model's round leaves out: it is measured per batch size (``answer``), and per depth of the build beside
    the verification (``answer_at``: a deeper build than the batch verifies is waited for), and added to every
    speculating round's price. With the int4 pair on a 2-core Intel Xeon, 8 MT-Bench requests at T = 0 waited
    26 ms after verifications of about 135 ms (median), and requests priced at 1.0-1.7x AR ran 0.8-0.9x.

    A sampled request with a seed chooses from its own verified rounds only: the profile's costs at batch 1 and
    (SSD) the hit rate the profile's hit curves give at its own acceptance, never a clock, a measured hit or its
    neighbours. Its K, and so its draws, are then the same alone or in any batch, run after run, as at a fixed
    K; requests without a seed use everything measured.

    In SSD the batch's build goes as deep as the most K asked of it, so each round the batch chooses that depth
    (``depth.batch_depth``: each request priced at each depth, the sum of their best gains) and every request's
    K stays within it (``self.depth``), but for one exploring a position, which deepens it by one.

    SSD with ``ssd.trees``: each round also picks the cache tree the speculator builds (``self.tree``, one for
    the batch, as the GPU build captures one shape per tree): every tree's gains come from ``tree_choice``'s
    model with the request's estimate, the tree whose sequences' best gains sum highest is taken (ties: the
    lower index, the plan's own first), and each request's K is its best in that tree. A tree's hit rate is
    the request's measured one moved by the model's difference from the tree its observed rounds were built
    in; a build's time is the profile's for the tree at the K asked, scaled as the measured builds were, and a
    build that outlasts the verification is cut when it ends, so a hit carries the steps it made
    (``tree_choice.TreeBuild``)."""

    def __init__(self, max_k: int, settings: AdaptSettings, costs: LiveCosts, priors: Priors,
                 ssd: SSDModel | None = None):
        super().__init__(settings.cap(max_k))
        self.settings = settings
        self.costs = costs
        self.profile = LiveCosts(dict(costs.target), dict(costs.draft))  # never timed: for seeded requests
        self.priors = priors
        self.ssd = ssd
        self.states: dict[int, RequestState] = {}
        # the last two rounds' trees and their predicted builds at K = 0..max (profile units), oldest first
        self.sent: deque[tuple[int, np.ndarray]] = deque(maxlen=2)
        self.build_scale: float | None = None  # measured build / the profile's for its tree (None: none measured)
        self.tree = 0
        self._tree_age, self._tree_batch = TREE_INTERVAL, frozenset()  # rounds since every tree was scored, for whom
        # the last gains computed: (the batch and what it had verified, the gains, rounds they were reused, depth)
        self._rest: tuple[tuple, list[np.ndarray], int, int | None] | None = None
        self.depth: int | None = None  # SSD: the steps of this round's build, the most K it lets a request ask
        self.zero: dict[int, ZeroRounds] = {}  # batch size -> its rounds at K = 0 (SSD)
        self.answer: dict[int, float] = {}  # batch size -> the speculator's answer after a verification (SSD), seconds
        self.answer_at: dict[tuple[int, int], float] = {}  # (batch size, its build's depth) -> the same

    def state(self, seq: Sequence) -> RequestState:
        state = self.states.get(seq.seq_id)
        if state is None:
            s, i = self.settings, self.priors.index(seq)
            prior = [s.prior] if s.prior is not None else self.priors.acceptance[i]
            state = self.states[seq.seq_id] = RequestState(
                i, AcceptanceEstimate(prior, s.prior_rounds, s.decay),
                AcceptanceEstimate([self.priors.p_hit[i]], s.prior_rounds, s.decay), interval=s.probe_interval)
        return state

    def _choose(self, seqs: list[Sequence]) -> list[int]:
        if self.max_k == 0 or not seqs:
            return [0] * len(seqs)
        gains = self._round_gains(seqs)
        ks = [self._one(seq, row, len(seqs)) for seq, row in zip(seqs, gains)]
        probes = sum(1 for seq, k in zip(seqs, ks) if k and self.states[seq.seq_id].probing)
        if probes and probes == sum(1 for k in ks if k) and self.ssd is not None:  # after rounds at K = 0 only
            self.zero.setdefault(len(seqs), ZeroRounds()).probed(probes)
        for seq, row, k in zip(seqs, gains, ks):
            seq.spec.gain_per_round.append(float(row[k]))
        if self.ssd is not None and self.ssd.trees is not None:
            # the branches asked of the build for each (none at K = 0); one call for the batch
            branches = branches_at(self.ssd.trees.fan_outs(seqs, self.tree, len(seqs))) if any(ks) else None
            for b, (seq, k) in enumerate(zip(seqs, ks)):
                seq.spec.fan_out_per_round.append(int(branches[b][k]) if k else 0)
        return ks

    def _round_gains(self, seqs: list[Sequence]) -> list[np.ndarray]:
        """Each sequence's gains at K = 0..max for this round. A batch that verified no draft last round (every
        request at K = 0) has learnt nothing: only the slowly moving pass costs could change its gains, so they
        are kept for up to ``TREE_INTERVAL`` such rounds. This keeps the chooser off an AR step's path."""
        # (whether it speculated last round sets its bar in the choice of the build's depth: ``_deepest``)
        key = tuple((s.seq_id, st.estimate.rounds, st.hit_rate.rounds, was_speculating(s))
                    for s, st in zip(seqs, map(self.state, seqs)))
        if self._rest is not None and self._rest[0] == key and self._rest[2] < TREE_INTERVAL:
            self._rest = (key, self._rest[1], self._rest[2] + 1, self._rest[3])
            self.depth = self._rest[3]
            if self.sent:  # the round is sent in the same tree, whose build is priced the same
                self.sent.append(self.sent[-1])
            return self._rest[1]
        live = self._live_gains(seqs, BatchCosts.at(self.costs, len(seqs), self.max_k))
        group = [s for s in seqs if is_seeded(s)]
        rows = dict(zip([s.seq_id for s in group], self._reproducible_gains(group) if group else []))
        live[:, 0] = self.zero_gain(len(seqs))
        gains = [rows.get(seq.seq_id, row) for seq, row in zip(seqs, live)]
        self._rest = (key, gains, 0, self.depth)
        return gains

    def _live_gains(self, seqs: list[Sequence], costs: BatchCosts) -> np.ndarray:
        """[B, max_k + 1] from everything measured, in the round's tree (SSD: chosen here, ``self.tree``) and at
        its build's depth (SSD: chosen here, ``self.depth``)."""
        self.depth = None
        if self.ssd is None:
            return self.gains(seqs, costs)
        # one request that counts (the rest seeded, or none): its own best K is the depth, priced as it is
        shared = sum(not is_seeded(s) for s in seqs) > 1
        trees = self.ssd.trees
        if trees is None:
            if not shared:
                return self.gains(seqs, costs)
            return self._deepest(seqs, [self.gains(seqs, costs, depth=d) for d in range(1, self.max_k + 1)])
        batch = frozenset(s.seq_id for s in seqs)
        if self._tree_age >= TREE_INTERVAL or batch != self._tree_batch:
            # every tree scored (milliseconds of numpy at batch 1); between times only the chosen one, which the
            # estimates move slowly away from
            gains, zero = self.tree_gains(seqs, costs), self.zero_gain(costs.batch)
            top = gains[..., 1:].max(axis=-1)  # a sequence that would not speculate in a tree counts K = 0's there
            best = np.where(top >= self.settings.min_gain * zero, top, zero)
            self.tree = int(np.argmax(best.sum(axis=1)))  # the first of equals: the plan's own tree first
            self._tree_age, self._tree_batch = 0, batch
        self._tree_age += 1
        depths = list(range(1, self.max_k + 1)) if shared else [None]
        by_depth = list(self.tree_gains(seqs, costs, [self.tree], depths=depths)[0])
        self.sent.append((self.tree, self.ssd.trees.build(seqs, self.tree, len(seqs), self.max_k).cost))
        return self._deepest(seqs, by_depth) if shared else by_depth[0]

    def _deepest(self, seqs: list[Sequence], by_depth: list[np.ndarray]) -> np.ndarray:
        """The gains at the round's build depth (``depth.batch_depth``, kept in ``self.depth``);
        ``by_depth[d - 1]``: the gains when the build goes d steps."""
        s, zero = self.settings, self.zero_gain(len(seqs))
        bar = zero * np.array([s.stay_gain if was_speculating(q) else s.min_gain for q in seqs])
        self.depth = batch_depth(by_depth, bar, zero, np.array([not is_seeded(q) for q in seqs]))
        return by_depth[self.depth - 1]

    def _reproducible_gains(self, seqs: list[Sequence]) -> np.ndarray:
        """[B, max_k + 1] for seeded requests: from their verified rounds and the profile alone, at batch 1. With
        the plan's trees, a request's hit rate is the model's at its own outcome law in the plan's tree (a hit
        rests on how far it accepts, which its rounds show: the prior's flat rate would price a request that
        accepts everything like an average one); a measured hit is left out, as it depends on the build's
        timing."""
        costs = BatchCosts.at(self.profile, 1, self.max_k)
        if self.ssd is None or self.ssd.trees is None:
            return self.gains(seqs, costs, True)
        return self.tree_gains(seqs, costs, [0], reproducible=True)[0]

    def tree_gains(self, seqs: list[Sequence], costs: BatchCosts, only: list[int] | None = None,
                   reproducible: bool = False, depths: list[int] | None = None) -> np.ndarray:
        """[trees, B, max_k + 1]: ``gains`` in each of the plan's trees (see the class docstring), or in ``only``
        those. ``reproducible``: the model's hit rate and the profile's build time, nothing measured.
        ``depths``: at each build depth (``TreeModel.build``: the build goes that many steps at the Ks below it),
        [trees, depths, B, max_k + 1], what does not depend on the depth computed once."""
        trees, states = self.ssd.trees, [self.state(seq) for seq in seqs]
        tokens = np.array([state.estimate.expected_tokens(self.max_k) for state in states])
        weights = np.array([state.estimate.outcome_pmf(self.max_k) for state in states])
        sources = [state.prior_index for state in states]
        if reproducible:
            observed, reference, scale = 0.0, 0.0, 1.0
        else:
            observed = np.array([state.hit_rate.rate(0) for state in states])
            built_in = self.sent[0][0] if self.sent else 0  # the tree the last verified speculations' cache was
            reference = trees.model_hits(trees.fan_outs(seqs, built_in, costs.batch), weights, sources)
            scale = self.build_scale if self.build_scale is not None else self.costs.target_scale
        backup = _column([self.priors.backup_acceptance[state.prior_index] for state in states])
        out = []
        for tree in range(trees.trees) if only is None else only:
            fan_outs = trees.fan_outs(seqs, tree, costs.batch)
            p_hit = np.clip(observed + trees.model_hits(fan_outs, weights, sources) - reference, 0.0, 1.0)
            hit = trees.hit_tokens(seqs, tree, fan_outs, tokens, weights, sources)
            at = []
            for d in [None] if depths is None else depths:
                # a build asked for K stops when the verification ends: it lasts until then (the pass in flight
                # included), and a hit carries the steps it made
                build = trees.build(seqs, tree, costs.batch, self.max_k, d)
                round_ = SSDRound(p_hit[:, None], build.cut_s * scale, self.ssd.jit_misses_at(costs.batch), backup,
                                  build.slowdown, 0.0 if reproducible else self.answers(costs.batch, d))  # K = 0..max
                at.append(ssd_gains(hit[:, build.done], costs, round_, miss_tokens=tokens))
            out.append(at[0] if depths is None else np.stack(at))
        return np.stack(out)

    def gains(self, seqs: list[Sequence], costs: BatchCosts, reproducible: bool = False,
              depth: int | None = None) -> np.ndarray:
        """[B, max_k + 1]: each sequence's predicted speedup over AR at K = 0..max_k in a round of ``costs``
        (one array computation for the batch: the chooser runs every round). ``reproducible``: from the
        profile's hit rate and build time, not the measured ones. ``depth`` (SSD): the build makes that many
        steps at the Ks below it."""
        states = [self.state(seq) for seq in seqs]
        tokens = np.array([state.estimate.expected_tokens(self.max_k) for state in states])
        if self.ssd is None:
            return sd_gains(tokens, costs)
        hit = [self.priors.p_hit[st.prior_index] if reproducible else st.hit_rate.rate(0) for st in states]
        # a build at K makes K + 1 passes: a deeper speculation is not free when the build outlasts the verification
        build = (self.profile if reproducible else self.costs).build_s(self.max_k, self.ssd.build_pass_prior_s)
        if depth is not None:
            build = np.maximum(build, build[min(depth, self.max_k)])
        round_ = SSDRound(_column(hit), build, self.ssd.jit_misses_at(costs.batch),
                          _column([self.priors.backup_acceptance[state.prior_index] for state in states]),
                          self.ssd.slowdown, 0.0 if reproducible else self.answers(costs.batch, depth))
        return ssd_gains(tokens, costs, round_)

    def answer_s(self, batch: int, depth: int | None = None) -> float:
        """What a speculating round at ``batch`` waits for the speculator's answer after its verification, as
        measured (0 until one is: the model's round ends with the verification or the build); with ``depth``,
        after a build of that many steps, as measured at this batch size (the batch size's until one is)."""
        at = self.answer_at.get((batch, depth)) if depth is not None else None
        return self.answer.get(batch, 0.0) if at is None else at

    def answers(self, batch: int, depth: int | None = None) -> np.ndarray:
        """[max_k + 1]: ``answer_s`` at K = 0..max_k, its build ``depth`` steps deep (or K's own, above it or
        without one)."""
        return np.array([self.answer_s(batch, max(k, depth or 0)) for k in range(self.max_k + 1)])

    def zero_gain(self, batch: int) -> float:
        """K = 0's speedup over AR at ``batch`` as measured (1 until its rounds are timed)."""
        rounds = self.zero.get(batch)
        return 1.0 if rounds is None else 1.0 / rounds.cost()

    def _one(self, seq: Sequence, gains: np.ndarray, batch: int) -> int:
        state, s = self.state(seq), self.settings
        cap = self.max_k if self.depth is None or is_seeded(seq) else self.depth  # the round's build's depth
        best = 1 + int(np.argmax(gains[1:cap + 1]))
        speculating = was_speculating(seq)  # last round: K > 0 or a probe
        # against what staying at K = 0 gives (``gains[0]``: 1 for a seeded request, whose choice reads no clock)
        if gains[best] >= (s.stay_gain if speculating else s.min_gain) * gains[0]:
            # one position deeper is priced from the prior while this request, which knows the positions before
            # it, has hardly tried it (a K that never drafts it never learns it): tried when its predicted gain
            # comes within explore_margin
            est = state.estimate
            # (a K one past the build's depth deepens it: the batch pays a step for the position explored)
            if (best < self.max_k and est.tried_at(best - 1) >= EXPLORE_TRIED > est.tried_at(best)
                    and gains[best + 1] >= (1.0 - s.explore_margin) * gains[best]):
                best += 1
            if (self.ssd is not None and not speculating and not state.start and not state.probe_due()
                    and not self._pays_unbuilt(seq, best, batch, gains[0])):
                state.start = best  # built beside this round's AR step (``ahead``), asked in the next
                state.at_zero += 1
                return 0
            state.at_zero, state.probing, state.interval, state.start = 0, False, s.probe_interval, 0
            self._price(state, gains, best)
            return best
        state.start = 0
        if state.probing:  # the probe did not pay: wait longer for the next one
            state.interval = self._wait(seq, min(2 * state.interval, s.max_probe_interval), batch)
            state.probing = False
        elif speculating or not seq.spec.k_per_round:  # its first round at K = 0 since it speculated, or at all
            state.interval = self._wait(seq, s.probe_interval, batch)
        if state.probe_due():
            state.at_zero, state.probing = 0, True
            self._price(state, gains, self._probe_k)
            return self._probe_k
        state.at_zero += 1
        return 0

    def _pays_unbuilt(self, seq: Sequence, k: int, batch: int, zero: float) -> bool:
        """Whether ``seq``, which did not speculate last round and has nothing built, gains by speculating ``k``
        now: its speculation is then drafted on the spot after the verification, which every request of the
        batch waits for, as in an SD round (priced so: ``sd_gains``). If it does not, it starts a round later, from
        a speculation built beside its AR step (``ahead``), as a probe does. With the int4 pair on a 2-core Xeon,
        8 MT-Bench requests at T = 0 waited 60-140 ms for such starts and admissions, beside verifications of
        120-200 ms. A seeded request prices it as its other choices, from the profile at batch 1."""
        seeded = is_seeded(seq)
        if not self.ssd.jit_misses_at(1 if seeded else batch):  # the miss strategy's backup drafts it, free
            return True
        costs = BatchCosts.at(self.profile if seeded else self.costs, 1 if seeded else batch, k)
        tokens = np.array(self.state(seq).estimate.expected_tokens(k))
        return float(sd_gains(tokens, costs)[k]) >= self.settings.min_gain * zero

    def _price(self, state: RequestState, gains: np.ndarray, k: int) -> None:
        """Keep what the coming round at ``k`` is predicted to cost, so that ``observe`` can tell what it gave (the
        expected tokens at max K, whose rates the round's gains have just read: E(k) is their prefix's)."""
        state.priced = (state.estimate.expected_tokens(self.max_k)[k] / gains[k], gains[0])

    def _wait(self, seq: Sequence, interval: int, batch: int) -> int:
        """The rounds at K = 0 before ``seq``'s next probe: ``interval``, or as many as make the probe cost a
        budget of them (``probe_cost``), up to ``max_probe_wait``. The budget is ``probe_budget``, or what
        speculating gained this request a round over its life (``RequestState.advantage``: its tokens against
        each round's predicted cost), if more: a text whose speculation paid well (code, math) is likely to pay
        again after a bad patch, and loses that much a round while it waits; one that hardly paid (chat on a dear
        verification) gains little from a probe that finds it again. Its tokens, not its predicted gains, which
        start from the profile's prior; a request that has not speculated yet has no such evidence and waits the
        interval. In a batch of b, a probe's cost falls on every request's round and what it finds speeds one of
        them: b requests probing alike cost the batch b times one's, so the wait is b times as long."""
        s, state = self.settings, self.state(seq)
        if not state.speculated:  # no round of its own says speculating does not pay: the prior put it at K = 0
            return interval
        budget = max(s.probe_budget, state.advantage)
        return max(interval, min(math.ceil(batch * self.probe_cost(seq, batch) / budget), s.max_probe_wait))

    def probe_cost(self, seq: Sequence, batch: int) -> float:
        """What ``seq``'s probe costs, in rounds of ``batch`` at K = 0: its own round's verification of ``probe_k``
        rows more (SD: and their drafts), less the tokens it is expected to bring (the request's estimate), and in
        SSD what its parts add to the rounds before it, as measured at this batch size (``ZeroRounds``), or until
        then (and always for a seeded request, whose choice reads no clock: the profile at batch 1) two rounds,
        the catch-up's and the build's, each slowed as the profile's contention probe found a verification
        beside one draft pass (``SSDModel.part_slowdown``: on avx2 with the int4 pair, measured parts added 0.28
        of a round each, the profile's probe moved to that tier 0.17 beside one draft row, and 0.01-0.08
        beside wider passes, within its noise)."""
        seeded = is_seeded(seq)
        costs, batch = (self.profile, 1) if seeded else (self.costs, batch)
        k, verify = self._probe_k, costs.verify(batch)
        gained = self.state(seq).estimate.expected_tokens(self.max_k)[k] - 1.0
        own = (costs.verify(batch + k) - verify) / verify - gained / batch
        if self.ssd is None:
            return max(own + k * costs.draft_step(1) / verify, 0.0)
        measured = None if seeded or batch not in self.zero else self.zero[batch].probe_parts()
        parts = measured if measured is not None else 2.0 * (self.ssd.part_slowdown - 1.0)
        return max(own, 0.0) + parts

    @property
    def _probe_k(self) -> int:
        return min(self.settings.probe_k, self.max_k)

    def ahead(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        # a request at K = 0 probes once its interval is out (``_one``), or starts to speculate where drafting on
        # the spot would not pay (``_pays_unbuilt``): its speculation is built beside the AR step before it, from
        # what that step verifies, so it is answered as a round is
        return [k or self._prepared(self.states.get(seq.seq_id)) for seq, k in zip(seqs, ks)]

    def _prepared(self, state: RequestState | None) -> int:
        """The K a request at K = 0 has built beside its coming AR step: its start's, its probe's, or none."""
        if state is None:
            return 0
        return state.start or (self._probe_k if state.probe_due() else 0)

    def catch_up(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        # a round earlier still, its draft cache takes the tokens of its rounds at K = 0 in the speculator's idle
        # time, where the build that prepares the probe would otherwise outlast the verification beside it: its
        # glue of every skipped token and one step over the batch's branches, priced by the draft's table, against
        # the coming round's verification. On avx2 that build took 63-97 ms beside a 45 ms AR step and the probe's
        # request waited for it. Elsewhere the tokens ride along in the build's one glue pass: fed in idle time they
        # are passes of their own beside the verification (8 requests on avx512: 0.83x AR where 0.95x without)
        due = [(seq, st) for seq, k in zip(seqs, ks)
               if k == 0 and (st := self.states.get(seq.seq_id)) is not None and st.probe_next_but_one()]
        if not due:
            return []
        verify = self.costs.verify(sum(k + 1 for k in ks))
        step = self.costs.draft_step(len(seqs))
        # by the build, it will have skipped this round's token and the next one's as well
        return [seq.seq_id for seq, st in due if self.costs.draft_step(st.at_zero + 2) + step > verify]

    def observe(self, seq: Sequence, drafted: int, kept: int, hit: bool | None = None) -> None:
        state = self.state(seq)
        state.estimate.observe(drafted, kept)
        priced, state.priced = state.priced, None  # a round that drafted nothing (the length's end) has no gain,
        # but for a miss answered with nothing (strategy "skip"): its one token is what the round's price bought
        if (drafted or hit is False) and priced is not None:  # what speculating gave against the price of K = 0
            cost, zero = priced
            state.speculated += 1
            state.advantage += ((1 + kept) / cost / zero - 1.0 - state.advantage) / state.speculated
        if hit is not None:  # the round asked for drafts: its speculation hit or missed
            state.hit_rate.observe(1, int(hit))
        seq.spec.acceptance_estimate = state.estimate.rates(self.max_k)

    def observe_verify(self, rows: int, seconds: float, beside_build: bool = False) -> None:
        # the tables hold the verification alone: one timed beside a build is divided by the bus slowdown
        slowdown = self.ssd.slowdown if self.ssd is not None and beside_build else 1.0
        self.costs.observe_verify(rows, seconds / slowdown)

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        self.costs.observe_draft(rows, steps, seconds)

    def observe_round(self, ks: list[int], seconds: float, beside_parts: bool = False) -> None:
        # only rounds with every request at K = 0: a mixed round's time is its speculations' as much
        if ks and not any(ks) and seconds > 0:
            self.zero.setdefault(len(ks), ZeroRounds()).observe(seconds, beside_parts)

    def observe_answer(self, batch: int, seconds: float, depth: int | None = None) -> None:
        self.answer[batch] = average(self.answer.get(batch), seconds, self.costs.weight)
        if depth:
            self.answer_at[batch, depth] = average(self.answer_at.get((batch, depth)), seconds, self.costs.weight)

    def observe_build(self, seconds: float, steps: int) -> None:
        self.costs.observe_build(seconds, steps)
        if self.ssd is None or self.ssd.trees is None or not self.sent or seconds <= 0:
            return
        # the build this response reports ran in the tree sent the round before; compared with that tree's
        # prediction at the steps it made (the K asked of it, or fewer when interrupted)
        predicted = self.sent[0][1][min(max(steps, 0), len(self.sent[0][1]) - 1)]
        if predicted > 0:
            ratio = seconds / predicted
            self.build_scale = average(self.build_scale, ratio, self.costs.weight)
            # a build is the draft's passes, predicted from the draft's table: so is a just-in-time miss, priced
            # by the same table (without this its scale would stay the target's, and a profile's guess of the
            # draft's relative cost would never be corrected)
            if self.ssd.builds_time_drafts:
                self.costs.observe_draft_scale(ratio)

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)


__all__ = ["AdaptiveK", "Priors", "RequestState", "SSDModel"]
