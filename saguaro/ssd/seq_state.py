"""What the SSD speculator keeps for one sequence, from its prefill or admission to its release.

One object per sequence: admitting, answering, building and forgetting a sequence touch this one place,
and ``free`` gives back every block it holds (its draft cache and its branch scratch).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from saguaro.eagle.features import FeatureLog
from saguaro.engine.sequence import Sequence
from saguaro.kv.block_manager import BlockManager
from saguaro.sampling.ranked import Ranked
from saguaro.sd.draft_model import DraftState
from saguaro.sd.ngram import NgramIndex
from saguaro.ssd.spoken import SpokenRow
from saguaro.ssd_settings import DraftedBy


@dataclass
class SeqState:
    seq: Sequence | None = None  # the speculator's copy of the sequence; None while it is only prefilled
    draft: DraftState = field(default_factory=DraftState)  # its draft KV cache: block table, tokens cached
    # the tokens a prefill puts in the draft cache, until its admission; after it, those a sequence at K = 0
    # catches up on before its probe (``Speculator._catch_up``); fed in idle time either way
    prefilled: list[int] | None = None
    sent: list[int] | None = field(default_factory=list)  # the speculation under verification; None: in ``spoken``
    drafted_by: DraftedBy = DraftedBy.PRIMARY  # the primary draft, or the point-mass backup (n-gram / random)
    ranked: list[Ranked] | None = None  # the draft's ranked ids at each position of it (primary only)
    spoken: SpokenRow | None = None  # where the speculation and its ranked ids wait on the device, unread
    scratch: list[int] = field(default_factory=list)  # blocks of the last build's branches, until the next respond
    ngram: NgramIndex = field(default_factory=NgramIndex)  # the n-gram backup's index of its tokens
    seed: int = 0  # the request's seed (``Admission.seed``): keys its build's counter uniforms (``counter_rng``)
    asked: int | None = None  # the K the verifier last asked of it (``RoundRequest.ks``; None: the plan's)

    @property
    def sent_count(self) -> int:
        return self.spoken.tokens if self.spoken is not None else len(self.sent)

    @property
    def ranked_count(self) -> int | None:
        """Positions of the speculation whose ranked ids it brought (None: none, e.g. a point-mass backup's)."""
        return self.spoken.ranked if self.spoken is not None else None if self.ranked is None else len(self.ranked)

    def take_features(self, start: int, rows: torch.Tensor | None, device: torch.device) -> None:
        """Record the target's features of positions ``start``.. (an EAGLE-3 speculator's messages carry them)."""
        if rows is None:
            return
        if self.draft.features is None:
            self.draft.features = FeatureLog(device)
        self.draft.features.put(start, rows)

    def free(self, blocks: BlockManager) -> None:
        """Give back the draft cache and the scratch."""
        blocks.free(self.draft.block_table)
        blocks.free(self.scratch)
