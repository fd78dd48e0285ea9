"""An optional recorder of bonus-token ranks: per-depth cache-hit curves from one run (calibration only).

For the speculation d_1..d_n under verification, the speculator already computes the draft's logits at
every depth k = 0..n (to pick the cache's top-F_k guesses). When the outcome (k, t*) arrives, the rank of
t* among those logits at depth k -- excluding d_{k+1} when k < n, exactly as the cache does -- tells for
*every* fan-out F at once whether the cache would have hit: hit iff rank < F. So

    p_hit^k(F) = P(rank < F | k accepted)          (k < K, Thm 13's p_hit^k),
    p_hit^{K,all}(F) = P(rank < F | all accepted), (depth K),

measured separately after a primary (draft model) and a backup (n-gram / random) speculation. A
``RecordingSpeculator`` feeds a ``RankRecorder``; it keeps one [n+1, V] logits block per sequence between a
build and the next request. The engine's own speculator records nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from saguaro.engine.model_runner import DraftRunner
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.protocol import Outcome
from saguaro.ssd.seq_state import SeqState
from saguaro.ssd_settings import DraftedBy
from saguaro.ssd.speculator import Speculator, BuildStats, seq_temperature
from saguaro.ssd.tree import BranchLayout


@dataclass
class RankRecord:
    drafted_by: DraftedBy  # who drafted the speculation: the primary draft or the point-mass backup
    drafted: int  # n, tokens in the speculation that was verified
    accepted: int  # k
    rank: int  # rank of the bonus token at depth k (0 = top); -1 when the logits were not available
    temperature: float
    hit: bool | None = None  # whether the speculation cache actually held the outcome
    seq_id: int = -1
    length: int = 0  # tokens in the sequence (prompt + output) after this round's accepted tokens and bonus


@dataclass
class RankRecorder:
    build_branches: bool = True  # False: glue and record only, decode no branches (cheaper calibration runs)
    records: list[RankRecord] = field(default_factory=list)
    _pending: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)

    def remember(self, seq_id: int, logits: torch.Tensor, speculation: list[int]) -> None:
        """``logits[k]``: the draft's next-token logits after the prefix and d_1..d_k (k = 0..n)."""
        self._pending[seq_id] = (logits, list(speculation))

    def observe(self, seq_id: int, drafted_by: DraftedBy, drafted: int, accepted: int, bonus: int,
                temperature: float) -> None:
        rank = -1
        held = self._pending.pop(seq_id, None)
        if held is not None and len(held[1]) == drafted:
            logits, sent = held
            if accepted < drafted and sent[accepted] == bonus:  # the verifier cut the speculation short (max_tokens)
                self.records.append(RankRecord(drafted_by, drafted, accepted, -1, temperature))
                return
            row = logits[accepted].float()
            above = row > row[bonus]
            if accepted < drafted:
                above[sent[accepted]] = False  # the drafted token is never the bonus token; the cache skips it
            rank = int(above.sum())
        self.records.append(RankRecord(drafted_by, drafted, accepted, rank, temperature))

    def forget(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)


class RecordingSpeculator(Speculator):
    """The speculator with a ``RankRecorder`` attached, as calibration runs it: in the engine's process
    (``in_process.InProcessLink``), every build complete. Each build ranks every depth of every speculation from
    its own glue (not from the ranked ids a speculation came with), and decodes the branches only with
    ``recorder.build_branches``: the ranks need only the glue's logits."""

    def __init__(self, runner: DraftRunner, plan: SpecPlan, recorder: RankRecorder):
        super().__init__(runner, plan)
        self.recorder = recorder

    def build(self, interrupted: Callable[[], bool] = lambda: False) -> BuildStats:
        for state in self.states.values():
            state.ranked = None  # the glue feeds, and so ranks, every depth
        return super().build()  # every glue and every step: never interrupted

    def _verified(self, state: SeqState, outcome: Outcome, hit: bool) -> None:
        self.recorder.observe(outcome.seq_id, state.drafted_by, len(state.sent), outcome.num_accepted, outcome.bonus,
                              seq_temperature(state.seq))
        record = self.recorder.records[-1]
        record.hit, record.seq_id, record.length = hit, outcome.seq_id, len(state.seq)

    def _glued(self, state: SeqState, logits: torch.Tensor) -> None:
        self.recorder.remember(state.seq.seq_id, logits, state.sent)

    def _decode_branches(self, states: list[SeqState], layouts: list[BranchLayout],
                         interrupted: Callable[[], bool]) -> BuildStats:
        if not self.recorder.build_branches:
            return BuildStats()
        return super()._decode_branches(states, layouts, interrupted)

    def _forget(self, seq_id: int) -> None:
        super()._forget(seq_id)
        self.recorder.forget(seq_id)
