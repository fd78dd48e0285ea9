"""The transport seam: how the verifier reaches its speculator.

``SSDDecoder`` depends on this protocol only, so where the speculator runs is a choice made
once, at start-up (``saguaro.placement``):

  * ``WorkerLink`` (``worker.py``): a process of its own, pinned to CPU cores or on another
    GPU; messages are packed into tensors and cross torch.distributed (``channel.py``: Gloo, and
    between two distinct GPUs the distributions and features over NCCL, GPU to GPU);
  * ``ThreadLink`` (``thread_link.py``): a thread of the target's process, fed through an
    in-process queue; messages pass as objects, and on a GPU it works on its own CUDA stream;
  * ``InProcessLink`` (``in_process.py``): no concurrency at all, each exchange responds and then
    builds the whole cache (calibration).

Every link carries the same two messages (``protocol.py``), and starts and serves its speculator the
same way (``host.py``): respond first, then build the next cache until the next request arrives. A link that cannot
deliver -- its speculator died, raised, or did not answer within ``worker_timeout_s`` --
raises ``ChannelClosed``; the decoder then finishes every request without it.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from saguaro.ssd.protocol import RoundRequest, RoundResponse


@runtime_checkable
class SpeculatorLink(Protocol):
    def post(self, request: RoundRequest) -> None:
        """Send a request that gets no response (admissions to prefill ahead of their first round, or a round
        whose every K is 0), without waiting. Raises ``ChannelClosed``."""

    def exchange(self, request: RoundRequest) -> RoundResponse:
        """One round: send the outcomes, wait for the next speculations. Raises ``ChannelClosed``."""

    def stop(self) -> None:
        """Ask the speculator to finish and wait for it (bounded); the link is unusable afterwards."""

    def kill(self) -> None:
        """Give up on the speculator now, without waiting for it to answer (after a failure)."""
