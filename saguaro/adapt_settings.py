"""The settings of per-request adaptive speculation, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptSettings:
    """How each request's K is chosen from round to round (``saguaro.adapt.schedule.AdaptiveK``).

    ``max_k`` caps K (None: the engine's ``num_speculative_tokens``); K = 0 is AR for that request.
    ``prior``: the acceptance assumed before a request's first rounds (None: the calibration profile's, by position),
    weighed as ``prior_rounds`` observed rounds. ``decay``: each new round's observation keeps this share of the older
    evidence (0.8: roughly the last 5 rounds count). A request at K = 0 probes with ``probe_k`` drafts after
    ``probe_interval`` rounds, the interval doubling after each probe that does not pay, up to ``max_probe_interval``;
    and never shorter than a probe's cost allows: the wait before a probe is at least its cost in rounds (its own
    round's loss and, in SSD, what its parts add to the rounds beside them) over a budget, times the batch size (its
    cost slows every request's round), up to ``max_probe_wait``. The budget is ``probe_budget``, or what speculating
    gained that request a round, if more (code after a bad patch probes at the intervals); a request that has not
    speculated yet waits the interval. Where a probe is cheap (a GPU, a draft whose parts hide) the intervals rule;
    where it is dear it waits longer (avx2 with the int4 pair: a probe's parts took 0.28 AR steps in each of two rounds,
    and at intervals of 4 to 8 they were 71% of what chat requests lost to AR). Speculation must beat K = 0 by
    ``min_gain`` (predicted speedup; K = 0 runs at AR's speed, or in SSD at what its rounds measure, with a
    probe's parts beside them) to be chosen; a request that speculated last round (or probed) keeps on while its
    best K is predicted at ``stay_gain`` times K = 0's or more. At K = 0 a request learns nothing, so one bad
    round near break-even must not end its speculation, and a text that turns predictable must be found again
    soon. In simulated requests (``bench adapt_sim``: the int4 pair's profile, acceptance 0.3-0.9 and a text that
    changes half way), this, the prior's weight of 3 rounds and probes after 4 to 8 rounds raised the worst ratio
    to the best fixed K from 0.91 to 0.95 (64 tokens). A K never drafts its next position, whose rate then stays
    the prior's guess: once a request knows the positions before it, K + 1 is tried while that position is hardly
    tried and its predicted gain is within ``explore_margin`` of the best (a seeded code request at T=1 otherwise
    stayed at K = 1 with 0.94 accepted).

    SSD can also choose each round's cache tree among the plan's own and a few more fixed at start-up
    (``saguaro.adapt.trees``): the plan's fan-outs scaled by each of ``fan_out_scales``, Thm 12's geometric shape
    at the plan's budget for each acceptance in ``fan_out_shapes``, and with ``taper`` the plan's fan-outs under
    the other taper (tapered if the plan's tree is full, full if it is tapered). All empty / False, the default:
    the plan's own tree every round. The choice is opt-in (``TREE_OPTIONS`` is the set measured) because it has
    not paid reliably: with the int4 pair's profile the row choosing trees built more branches and ran below the
    plan-tree row in 21 of 32 cells of six ``bench adapt`` runs, above it in 19 of 24 cells of the three after
    those, and in 3 of 8 of the first run with the rows interleaved (``results/bench_adapt_int4.md``). The
    trees are scored with the profile's hit curves, so they are offered only with a calibrated profile (``saguaro
    calibrate``), or with ``trees_without_profile``: the documented defaults' curves are a guess.
    """
    max_k: int | None = None
    prior: float | None = None
    prior_rounds: float = 3.0
    decay: float = 0.8
    probe_k: int = 1
    probe_interval: int = 4
    max_probe_interval: int = 8
    probe_budget: float = 0.03
    max_probe_wait: int = 64
    min_gain: float = 1.02
    stay_gain: float = 0.95
    explore_margin: float = 0.05
    fan_out_scales: tuple[float, ...] = ()
    fan_out_shapes: tuple[float, ...] = ()
    taper: bool = False
    trees_without_profile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fan_out_scales", tuple(self.fan_out_scales))  # a list from JSON or a CLI
        object.__setattr__(self, "fan_out_shapes", tuple(self.fan_out_shapes))
        if any(not s > 0 for s in self.fan_out_scales):
            raise ValueError(f"adaptive fan_out_scales must be > 0, got {list(self.fan_out_scales)}")
        if any(not 0.0 < a < 1.0 for a in self.fan_out_shapes):
            raise ValueError(f"adaptive fan_out_shapes are acceptances in (0, 1), got {list(self.fan_out_shapes)}")
        if self.max_k is not None and (not isinstance(self.max_k, int) or self.max_k < 0):
            raise ValueError(f"adaptive max_k must be an integer >= 0 (0: AR), got {self.max_k!r}")
        if self.prior is not None and not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"adaptive prior acceptance must lie in [0, 1], got {self.prior}")
        if self.prior_rounds <= 0:
            raise ValueError(f"adaptive prior_rounds must be > 0, got {self.prior_rounds}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"adaptive decay must lie in [0, 1), got {self.decay}")
        if self.probe_k < 1:
            raise ValueError(f"adaptive probe_k must be >= 1, got {self.probe_k}")
        if self.probe_interval < 1 or self.max_probe_interval < self.probe_interval:
            raise ValueError(f"adaptive probe intervals need 1 <= probe_interval <= max_probe_interval, got "
                             f"{self.probe_interval} and {self.max_probe_interval}")
        if not 0.0 < self.probe_budget <= 1.0:
            raise ValueError(f"adaptive probe_budget must lie in (0, 1], got {self.probe_budget}")
        if self.max_probe_wait < self.max_probe_interval:
            raise ValueError(f"adaptive max_probe_wait must be >= max_probe_interval = {self.max_probe_interval}, "
                             f"got {self.max_probe_wait}")
        if self.min_gain <= 0:
            raise ValueError(f"adaptive min_gain must be > 0, got {self.min_gain}")
        if not 0.0 <= self.explore_margin < 1.0:
            raise ValueError(f"adaptive explore_margin must lie in [0, 1), got {self.explore_margin}")
        if not 0 < self.stay_gain <= self.min_gain:
            raise ValueError(f"adaptive stay_gain must lie in (0, min_gain = {self.min_gain}], got {self.stay_gain}")

    def cap(self, k: int) -> int:
        """The largest K a request may use when the engine speculates ``k`` tokens."""
        return k if self.max_k is None else min(k, self.max_k)


# the cache trees ``bench adapt`` measured beside the plan's (opt in: ``AdaptSettings(**TREE_OPTIONS)``): the plan's
# fan-outs at half and twice its budget, Thm 12's shapes for acceptance 0.3 and 0.9, and the other taper
TREE_OPTIONS = dict(fan_out_scales=(0.5, 2.0), fan_out_shapes=(0.3, 0.9), taper=True)
