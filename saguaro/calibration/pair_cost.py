"""Without a calibration profile: a draft step's cost relative to a target step, from the pair's weight bytes, and
what more rows cost each model, from the kernels' measured row curves.

On the CPU a decode pass streams every weight once, so its time follows its bytes (``pass_bytes``: the packed
formats, the draft's reduced head) plus a fixed cost per pass (Python, dispatch, attention, the epilogues),
counted here as ``PASS_OVERHEAD_BYTES`` of weights. The documented default (``DEFAULTS["draft_ratio"]``, 0.38)
describes a draft about a third the target's size; a pair whose draft streams a tenth of the target's bytes
(the 0.5B in int4 beside the 1.5B in bf16: 0.09) would otherwise be modelled as three times too dear, and every
request that chooses K from the profile alone (a seeded sampled one: ``AdaptiveK``) would speculate too
little. So the estimate replaces the default where it is lower; where it is higher (a draft as large as its
target, the tests' tiny pairs, whose passes are all overhead) the default stands. On a GPU passes of small
models are bound by their launches rather than their bytes: the default stands there too.

More rows are not nearly free on every kernel (``backends/cpu_kernels/row_costs.py``): an int4 target verifies
5 rows at about twice a decode step's time on an avx512 core, where the documented slope says 8% more. A request
that chose K from that slope speculated 5 deep on chat, slower than AR. So where the engine runs the bf16
kernels, each model's row curve is its weights' share of the pass times the kernels' measured GEMM curve for
its format, plus the overhead's share, flat (``pass_curve``).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from saguaro.calibration.profile import DEFAULTS, ROW_GRID, ContentionProbe, PairCosts, Timing
from saguaro.calibration.timeline import rows_time
from saguaro.config import Config

log = logging.getLogger("saguaro.calibration")

PASS_OVERHEAD_BYTES = 32 << 20  # about 1.5 ms of a pass that is not its weights, at ~20 GB/s


def byte_ratio(target_bytes: int, draft_bytes: int) -> float:
    return (draft_bytes + PASS_OVERHEAD_BYTES) / (target_bytes + PASS_OVERHEAD_BYTES)


def pair_costs(cfg: Config) -> PairCosts:
    """What the default profile can know of ``cfg``'s pair without a calibration: nothing on a GPU or where the
    target's config cannot be read; else the draft's byte ratio (where below the documented default), and on
    the bf16 kernels the target's row curve and the draft's (a draft whose config cannot be read: neither)."""
    if cfg.device != "cpu" or cfg.draft_device not in (None, "cpu"):
        return PairCosts()
    from saguaro.backends.cpu_kernels.model import pass_bytes
    target, draft = _config(cfg.target), _config(cfg.draft)
    if target is None:
        return PairCosts()
    fmt = cfg.draft_format
    target_bytes = pass_bytes(target, cfg.target_weights)
    draft_bytes = draft and pass_bytes(draft, fmt.weights, min(fmt.vocab or draft.vocab_size, draft.vocab_size))
    ratio = byte_ratio(target_bytes, draft_bytes) if draft_bytes else None
    if ratio is not None and ratio >= DEFAULTS["draft_ratio"]:
        ratio = None
    elif ratio is not None:
        log.info("no calibration profile: a draft step is taken as %.3f of a target step (the pair's weight "
                 "bytes)", ratio)
    curves = None if cfg.enforce_eager or cfg.torch_dtype != torch.bfloat16 else _row_curves()
    if curves is None:
        return PairCosts(ratio)
    return PairCosts(ratio, pass_curve(target_bytes, curves(cfg.target_weights)),
                     pass_curve(draft_bytes, curves(fmt.weights)) if draft_bytes else None)


def _config(name):
    """A registered model's or a checkpoint's config; None for what cannot be read as one (an n-gram matcher, an
    EAGLE-3 head, a model given in memory): the defaults apply to it."""
    from saguaro.loading import load_config
    if not isinstance(name, str):
        return None
    try:
        return load_config(name, progress=False)
    except (OSError, ValueError, LookupError, RuntimeError):
        return None


def pass_curve(weight_bytes: int, gemm: dict[int, float]) -> dict[int, float]:
    """A pass over n rows against one row: its weights' GEMMs follow the kernels' curve, the rest of the pass
    (``PASS_OVERHEAD_BYTES``) barely grows with the rows."""
    return {n: (weight_bytes * c + PASS_OVERHEAD_BYTES) / (weight_bytes + PASS_OVERHEAD_BYTES) for n, c in gemm.items()}


def _row_curves():
    """``weights`` -> the kernels' GEMM row curve on ROW_GRID (``row_costs``: measured once per CPU), or None
    where the kernels cannot be built (the engine then runs the eager reference)."""
    from saguaro.backends.cpu_kernels import build, row_costs
    try:
        ops = build.load()
    except build.KernelsUnavailable:
        return None
    return lambda weights: row_costs.curve(ops, weights, ROW_GRID)


def reshaped(timing: Timing, costs: PairCosts, k: int) -> Timing:
    """``timing`` with each model's row table its one-row time times ``costs``' row curve (a model without a curve
    keeps its table): a profile timed on another kernel tier, whose one-row times (the bus's) still hold but
    whose extra rows cost what that tier's kernels made of them. ``k``: the profile's K (its verification).
    Its contention probe is moved with them (``contended``)."""
    def table(rows: dict[str, float], curve: dict[int, float] | None) -> dict[str, float]:
        return rows if curve is None else {str(n): rows["1"] * curve[n] for n in ROW_GRID}

    target, draft = table(timing.target_rows, costs.target_rows), table(timing.draft_rows, costs.draft_rows)
    verify = float(np.interp(k + 1, ROW_GRID, [target[str(n)] for n in ROW_GRID]))
    moved = replace(timing, target_rows=target, draft_rows=draft)
    return replace(moved, verify_s=verify, T_p=k * timing.draft_step_s / verify, T_b=timing.ngram_s / verify,
                   raw=None, contention=contended(timing, moved))


def contended(timing: Timing, moved: Timing) -> ContentionProbe | None:
    """``timing``'s contention probe for passes that take ``moved``'s row times. A pass slows its neighbour on
    the bus by how fast it pulls its bytes: the same bytes over a longer pass pull less, and a verification
    that computes longer waits on the bus for a smaller share of its time. So each probed draft width's extra
    slowdown (s - 1) scales by the draft's pass-time ratio at that width times the verification's at the
    probe's rows, and the draft's own by the verification's. Checked on one Zen 4 core, the int4 pair's avx512
    probe moved to the avx2 kernels: 1.14, 1.05, 1.03 and 1.00 at 1, 4, 8 and 16 draft rows against 1.18,
    1.10, 1.00 and 1.07 measured there (unmoved: 1.27, 1.17, 1.09 and 1.01)."""
    probe = timing.contention
    if probe is None or not probe.busy:
        return probe
    verify = rows_time(timing.target_rows, probe.rows or 1) / rows_time(moved.target_rows, probe.rows or 1)
    busy = []
    for b in probe.busy:
        alone, alone_moved = rows_time(timing.draft_rows, b.draft_rows), rows_time(moved.draft_rows, b.draft_rows)
        rate = 0.0  # the busy draft's pass rate: its own slowdown, scaled, over its moved time alone
        if b.draft_passes_per_s > 0:
            own = 1.0 / (b.draft_passes_per_s * alone)
            rate = 1.0 / (alone_moved * (1.0 + (own - 1.0) * verify))
        busy.append(replace(b, slowdown=1.0 + (b.slowdown - 1.0) * alone / alone_moved * verify,
                            draft_passes_per_s=rate))
    return replace(probe, busy=busy)
