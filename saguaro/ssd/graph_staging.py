"""The host's part of a graph build: choose its ``BuildShape``, lay out each sequence's cache, pack its staging row.

Per build this is Python over the sequences (block bookkeeping and a list of ints each) and no torch call: the
rows become one tensor and one copy in ``GraphBuild.run``. Where the sequences do not share one shape, or one
of them needs what the graph does not do (see ``graph_build.py``), ``stage`` answers None and the speculator
runs its Python build, which computes the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.ssd.cache import BranchGroup
from saguaro.backends.paged.graphs import SEQ_BUCKETS
from saguaro.ssd.graph_build import BuildShape, float_bits
from saguaro.ssd.seq_state import SeqState
from saguaro.ssd_settings import DraftedBy


@dataclass
class StagedBuild:
    shape: BuildShape
    rows: list[list[int]]  # one staging row per sequence, in ``states`` order
    groups: list[BranchGroup]  # each sequence's branches in the build's tables
    # (staging row, ``Spoken`` row) of each sequence whose speculation and ranked ids are still on the device:
    # its row's d_1..d_K and ranked ids are written there from ``Spoken`` (``GraphBuild.run``)
    spoken: list[tuple[int, int]]


def outcome_counts(fan_out: list[int], k: int, ranked: int) -> tuple[int, ...]:
    """Outcomes ``predict_outcomes`` prepares at each depth for a full speculation of K tokens, when the ranking
    holds ``ranked`` ids per position: F_k, or fewer where the ranking (the drafted token excluded) runs out."""
    return tuple(min(fan_out[min(d, len(fan_out) - 1)], ranked - (d < k)) for d in range(k + 1))


def glue_start(state: SeqState) -> int:
    """The first position the glue feeds (``Speculator._glue``): the draft cache's end, or the last verified
    token when its logits are needed; positions whose k/v and ranked ids came with the speculation are kept."""
    base, ranked = len(state.seq) - 1, state.ranked_count
    start = min(state.draft.num_cached, base)
    if ranked is not None and state.draft.num_cached >= base:
        start = min(state.draft.num_cached, base + ranked, base + state.sent_count)
    return start


def choose_shape(spec, states: list[SeqState], temperature) -> BuildShape | None:
    """The one shape every sequence of the build fits, or None. ``spec``: the ``Speculator``."""
    k, graphs = spec.k, spec.runner.backend.graphs
    width = min(spec.width, spec.runner.config.vocab_size)
    if (len(states) > SEQ_BUCKETS[-1] or spec.conditioned or spec.saguaro_sampling is not None
            or any(s.sent_count != k or glue_start(s) < len(s.seq) - 1 for s in states)):
        return None
    if any(len(r.ids) < width for s in states for r in (s.ranked or [])[:glue_start(s) - len(s.seq) + 1]):
        return None  # a staged ranking shorter than the graph's
    fan_outs = {tuple(spec.fan_out_for(s)) for s in states}
    temps = {spec.plan.steps_for(temperature(s.seq), spec.tree) for s in states}
    if len(fan_outs) != 1 or len(temps) != 1:
        return None
    need = -(-(max(len(s.seq) for s in states) + k) // spec.runner.block_size)
    if need > graphs.max_table_blocks:
        return None
    params = [s.seq.params for s in states]
    sampled = not all(p.greedy for p in params)
    filters = any(not p.greedy and (0 < p.top_k < spec.runner.config.vocab_size or p.top_p < 1) for p in params)
    return _shape(spec, len(states), fan_outs.pop(), temperature(states[0].seq), sampled, filters, spec.tree)


def _shape(spec, seqs: int, fan_out, temperature: float, sampled: bool, filters: bool,
           tree: int = 0) -> BuildShape | None:
    """The shape of a build of ``seqs`` sequences with this fan-out, the taper of the plan's ``tree`` (at
    ``temperature``) and sampling; None when it prepares no branch."""
    k, width = spec.k, min(spec.width, spec.runner.config.vocab_size)
    counts = outcome_counts(list(fan_out), k, width)
    branches = sum(counts)
    if not branches:
        return None
    widths = tuple(min(branches, w) for w in spec.plan.branch_widths(branches, temperature, tree))
    bucket = next(b for b in SEQ_BUCKETS if b >= seqs)
    return BuildShape(bucket, k, counts, widths, width, spec.runner.backend.graphs.max_table_blocks, sampled, filters)


def startup_shapes(spec, max_seqs: int) -> list[BuildShape]:
    """Every shape ``choose_shape`` can answer for rounds of at most ``max_seqs`` sequences, to capture at start-up
    (``GraphBuild.capture_all``): on a GPU a capture later would run beside the target's verification, and a
    capture synchronizes the device. Per batch size (the fan-outs follow it), every bucket of the sequences that
    build, every tree the plan offers (the adaptive schedule picks one per round), every temperature's fan-outs
    and taper, both drafters, and greedy / sampled / filtered."""
    if spec.conditioned or spec.saguaro_sampling is not None:
        return []  # these always take the Python build
    plan, shapes = spec.plan, {}
    for batch in range(1, min(max_seqs, SEQ_BUCKETS[-1]) + 1):
        buckets = sorted({next(b for b in SEQ_BUCKETS if b >= n) for n in range(1, batch + 1)})
        for tree in range(plan.trees):
            for temperature in plan.temperatures:
                for drafted_by in DraftedBy:
                    fan_out = plan.fan_out(temperature, drafted_by, batch, tree)
                    for seqs in buckets:
                        for sampled, filters in ((False, False), (True, False), (True, True)):
                            shape = _shape(spec, seqs, fan_out, temperature, sampled, filters, tree)
                            if shape is not None:
                                shapes[shape] = None
    return list(shapes)


def stage(spec, states: list[SeqState], temperature) -> StagedBuild | None:
    """Lay out every sequence's glue and scratch and pack its staging row; None where the graph cannot build.
    ``temperature(seq)``: the temperature its plan is looked up at."""
    shape = choose_shape(spec, states, temperature)
    if shape is None:
        return None
    blocks, k, size = spec.runner.blocks, shape.k, shape.offsets[-1]
    done = shape.pass_rows
    rows, groups, spoken = [], [], []
    for n, state in enumerate(states):
        seq, draft = state.seq, state.draft
        base, start = len(seq) - 1, glue_start(state)
        blocks.truncate(draft.block_table, start)
        blocks.reserve(draft.block_table, base + k + 1)
        draft.num_cached = base + k + 1
        blocks.reserve(state.scratch, size)
        scratch = spec.runner.slots(state.scratch, 0, size)
        known = start - base
        if state.spoken is not None:
            spoken.append((n, state.spoken.row))
        ids, probs = _known_ranks(state, 0 if state.spoken is not None else known, k, shape.width)
        sent = state.sent if state.spoken is None else [0] * k
        p = seq.params
        rows.append([1, base, known, int(p.greedy), float_bits(p.temperature), int(p.top_k), float_bits(p.top_p),
                     state.seed] + (seq.tokens[base:] + sent) + draft.block_table
                    + [0] * (shape.table_width - len(draft.block_table)) + scratch + ids + probs)
        step_rows = [done[j] + n * w for j, w in enumerate(shape.widths)]
        groups.append(BranchGroup(n * shape.branches, shape.branches, step_rows, list(shape.widths), not p.greedy,
                                  scratch, shape.offsets[:k]))
    return StagedBuild(shape, rows, groups, spoken)


def _known_ranks(state: SeqState, known: int, k: int, width: int) -> tuple[list[int], list[int]]:
    """The staged ranked ids and probabilities (float bits) of depths 0..K: the known depths', zeros past them."""
    ids, probs = [0] * ((k + 1) * width), [0] * ((k + 1) * width)
    for d in range(known):
        r = state.ranked[d]
        ids[d * width:d * width + len(r.ids[:width])] = r.ids[:width]
        probs[d * width:d * width + len(r.probs[:width])] = [float_bits(x) for x in r.probs[:width]]
    return ids, probs
