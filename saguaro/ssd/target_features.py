"""The verifier's side of an EAGLE-3 speculator: the target's features of each pass, for the messages.

The target runner's tap (``ModelRunner.tap``) hands over its taps' inputs after every pass. A prefill
chunk's rows leave with that chunk's ``CMD_PREFILL``, sent right after the target's pass (the head cannot
prefill before the target has); a verification pass's rows wait here until the outcome takes the verified
positions' (the last token's and the accepted drafts'). Both are views of the tap's tensor: the thread
transport hands them over as they are, the process transport packs them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.ssd.protocol import RoundRequest


class TargetFeatures:
    def __init__(self, target: ModelRunner, layers: list[int]):
        self.rows: list[torch.Tensor] = []  # the last pass's rows, per item [len(item), A*H_t]
        self.starts: list[int] = []  # the position of each item's first row
        self._after: Callable[[], None] | None = None
        target.tap(layers, self._observe)

    def after_next_pass(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the target's next pass has its features here."""
        self._after = callback

    def verified(self, b: int, num_accepted: int) -> torch.Tensor:
        """The features of item ``b``'s verified positions in the last (verification) pass [k+1, A*H_t]."""
        return self.rows[b][:num_accepted + 1]

    def attach(self, request: RoundRequest) -> RoundRequest:
        """A prefill request with each admission's chunk features (admissions in the last pass's item order)."""
        for adm, rows, start in zip(request.admissions, self.rows, self.starts):
            adm.features, adm.features_start = rows, start
        return request

    def _observe(self, items: list[ForwardItem], features: torch.Tensor) -> None:
        self.rows = list(features.split([len(i.token_ids) for i in items]))
        self.starts = [i.start for i in items]
        callback, self._after = self._after, None
        if callback is not None:
            callback()
