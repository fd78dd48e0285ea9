"""Closed-form theory of SSD / Saguaro (paper Secs. 3-4, Appendix A) and a Monte Carlo check of it.

Modules: ``speedup`` (Thm 2, Cors. 3, 4, 17, stationary hit rate), ``bandwidth`` (the ceiling on SSD when
the two devices share one memory bus), ``miss_strategy`` (Thm 18, critical batch
size b*), ``fanout`` (Thm 12 geometric fan-out, rounding, power-law fit), ``fanout_general`` (Thm 13 with
empirical hit curves), ``hit_tradeoff`` (Def. 14 sampling: acceptance against cache hits, Thm 15, Appendix
A), ``simulate`` (Monte Carlo of SD / SSD rounds). Pure Python + NumPy.
"""

from .bandwidth import bus_cap, ssd_round_floor, ssd_tok_s_ceiling
from .miss_strategy import choose_miss_strategy, critical_batch_size, miss_strategy_speedups
from .fanout import (
    fanout_objective,
    fit_power_law,
    geometric_fanout,
    integer_geometric_fanout,
    power_law_hit,
    round_fanout,
)
from .fanout_general import depth_weights, dp_fanout, greedy_fanout, is_concave, optimal_fanout
from .hit_tradeoff import (
    APPENDIX_CONSTRUCTION,
    acceptance_rate,
    hit_probability_on_rejection,
    hit_probability_one_token,
    rejection_mass,
    residual_distribution,
    saguaro_hit_rate_on_rejection,
    saguaro_probs,
    top_f_mask,
)
from .simulate import SimResult, sample_accepted, simulate_hit_chain, simulate_sd, simulate_ssd
from .speedup import (
    accepted_length_pmf,
    expected_tokens,
    hit_rate_after_rounds,
    sd_speedup,
    ssd_over_sd_bounds,
    ssd_same_speculator_speedup,
    ssd_speedup,
    ssd_speedup_batch,
    ssd_speedup_batch_limit,
    unconditional_hit_rate,
)

__all__ = [
    "APPENDIX_CONSTRUCTION",
    "SimResult",
    "acceptance_rate",
    "accepted_length_pmf",
    "bus_cap",
    "choose_miss_strategy",
    "critical_batch_size",
    "depth_weights",
    "dp_fanout",
    "expected_tokens",
    "miss_strategy_speedups",
    "fanout_objective",
    "fit_power_law",
    "geometric_fanout",
    "greedy_fanout",
    "hit_probability_on_rejection",
    "hit_probability_one_token",
    "hit_rate_after_rounds",
    "integer_geometric_fanout",
    "is_concave",
    "optimal_fanout",
    "power_law_hit",
    "rejection_mass",
    "residual_distribution",
    "round_fanout",
    "saguaro_hit_rate_on_rejection",
    "saguaro_probs",
    "sample_accepted",
    "sd_speedup",
    "simulate_hit_chain",
    "simulate_sd",
    "simulate_ssd",
    "ssd_over_sd_bounds",
    "ssd_round_floor",
    "ssd_same_speculator_speedup",
    "ssd_speedup",
    "ssd_speedup_batch",
    "ssd_speedup_batch_limit",
    "ssd_tok_s_ceiling",
    "top_f_mask",
    "unconditional_hit_rate",
]
