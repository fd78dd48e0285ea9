"""Posts to the speculator process that the target does not wait for.

A Gloo send returns once the peer has taken the message, and a speculator in the middle of a build or a draft
prefill takes it only when that pass ends. A prefill chunk's post (``SSDDecoder.prefilling``) and a quiet
round's (every K = 0) expect no answer, yet each held the target that long: with an int4 pair on a 2-core
Intel Xeon, 8 MT-Bench prompts' posts waited 53 ms each at the median, 1.6 s of a 9 s prefill. So posts go to
one sender thread, in order; a round that wants an answer (``flush``) first waits until the speculator holds
every message before it, as a blocking send did.

Glossary:
  post    a message without an answer: put in the outbox, sent in order on the sender thread.
  flush   wait until every message put so far has been taken; raise the first send's failure.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from saguaro.ssd.channel import ChannelClosed

Message = list[torch.Tensor]
_CLOSE = None  # the sentinel that ends the sender thread


class Outbox:
    """FIFO sends of ``send`` on a daemon thread (one blocked by a stalled peer must not hold up the exit). A send
    that fails is kept and raised by the next ``put`` or ``flush``; the messages after it are dropped, as the link
    is then closed."""

    def __init__(self, send: Callable[[Message], None], name: str = "saguaro-ssd-outbox"):
        self._send = send
        self._queue: queue.Queue[Message | None] = queue.Queue()
        self._error: ChannelClosed | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: Message) -> None:
        self._raise()
        self._queue.put(message)

    def flush(self) -> None:
        self._queue.join()
        self._raise()

    def close(self) -> None:
        """End the sender thread once the messages before this call are sent."""
        if self._thread.is_alive():
            self._queue.put(_CLOSE)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            try:
                if message is _CLOSE:
                    return
                if self._error is None:
                    self._send(message)
            except ChannelClosed as e:
                self._error = e
            except Exception as e:  # noqa: BLE001 -- any failed send closes the link for its caller
                self._error = ChannelClosed(f"send failed: {e}")
            finally:
                self._queue.task_done()
