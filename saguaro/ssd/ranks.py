"""An optional recorder of bonus-token ranks: per-depth cache-hit curves from one run (calibration only).

For the speculation d_1..d_n under verification, the speculator already computes the draft's logits at
every depth k = 0..n (to pick the cache's top-F_k guesses). When the outcome (k, t*) arrives, the rank of
t* among those logits at depth k -- excluding d_{k+1} when k < n, exactly as the cache does -- tells for
*every* fan-out F at once whether the cache would have hit: hit iff rank < F. So

    p_hit^k(F) = P(rank < F | k accepted)          (k < K, Thm 13's p_hit^k),
    p_hit^{K,all}(F) = P(rank < F | all accepted), (depth K),

measured separately after a primary (draft model) and a backup (n-gram / random) speculation. Off by default;
when on it keeps one [n+1, V] logits block per sequence between a build and the next request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RankRecord:
    source: str  # "p": the speculation came from the primary draft, "b": from the fast backup
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

    def observe(self, seq_id: int, source: str, drafted: int, accepted: int, bonus: int, temperature: float) -> None:
        rank = -1
        held = self._pending.pop(seq_id, None)
        if held is not None and len(held[1]) == drafted:
            logits, spec = held
            if accepted < drafted and spec[accepted] == bonus:  # the verifier cut the speculation short (max_tokens)
                self.records.append(RankRecord(source, drafted, accepted, -1, temperature))
                return
            row = logits[accepted].float()
            above = row > row[bonus]
            if accepted < drafted:
                above[spec[accepted]] = False  # the drafted token is never the bonus token; the cache skips it
            rank = int(above.sum())
        self.records.append(RankRecord(source, drafted, accepted, rank, temperature))

    def forget(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)
