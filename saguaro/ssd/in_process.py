"""``InProcessLink``: the speculator without a transport, in the caller's thread and process.

Each exchange responds and then builds the whole cache before returning (a build that is never
interrupted). Calibration uses it to record bonus-token ranks deterministically; it is not meant for speed.
"""
from __future__ import annotations

from typing import Any

from saguaro.ssd.channel import ChannelClosed
from saguaro.ssd.host import SpeculatorOptions, handle, start_speculator
from saguaro.ssd.protocol import RoundRequest, RoundResponse
from saguaro.ssd.ranks import RankRecorder
from saguaro.ssd.speculator import Speculator


class InProcessLink:
    """A ``SpeculatorLink`` that serves each request synchronously, here."""

    def __init__(self, draft: Any, opts: SpeculatorOptions, recorder: RankRecorder | None = None):
        self.opts = opts
        self.speculator: Speculator | None = start_speculator(draft, opts, recorder)

    def post(self, request: RoundRequest) -> None:
        handle(self._live(), request, lambda response: None)  # no response to it

    def exchange(self, request: RoundRequest) -> RoundResponse:
        responses: list[RoundResponse] = []
        handle(self._live(), request, responses.append)
        return responses[0]

    def stop(self) -> None:
        if self.speculator is not None:
            self.speculator.close()
            self.speculator = None

    kill = stop

    def _live(self) -> Speculator:
        if self.speculator is None:
            raise ChannelClosed("in-process speculator was stopped")
        return self.speculator

