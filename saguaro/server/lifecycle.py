"""What bounds a request's and the server's time: the limits a server runs with, the request-body
deadline, and the graceful-shutdown deadline.

Glossary:
  body deadline     a client must send its whole request body within ``body_timeout_s`` of connecting
                    the request, or it gets a 408 and the connection is freed (a slow or stalled
                    sender cannot hold a connection forever).
  shutdown deadline on SIGTERM/SIGINT the server stops accepting connections and lets the requests in
                    flight finish for ``shutdown_timeout_s``; then every one left ends with finish
                    reason "abort" (streams get their last chunk and ``[DONE]``), and the engine, with
                    its SSD speculator, is closed.
  stall             the engine loop has not completed a step for ``health_stall_s`` while work waits:
                    ``/health`` answers 503.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import uvicorn

log = logging.getLogger("saguaro.server")


@dataclass(frozen=True)
class ServerLimits:
    max_choices: int = 128  # prompts x n in one request
    body_timeout_s: float = 30.0  # to receive a request's whole body
    shutdown_timeout_s: float = 30.0  # for requests in flight after SIGTERM, before they are aborted
    health_stall_s: float = 60.0  # /health is 503 once the engine has made no step this long with work waiting
    max_request_bytes: int | None = None  # a longer body gets a 413; None: derived from the context (request_limits)

    def __post_init__(self) -> None:
        if self.max_choices < 1:
            raise ValueError(f"max_choices must be >= 1, got {self.max_choices}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        for name in ("body_timeout_s", "shutdown_timeout_s", "health_stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class BodyDeadline:
    """ASGI middleware: read a request's whole body within ``timeout_s`` (then hand it to the app), else 408."""

    def __init__(self, app, timeout_s: float, on_timeout: Callable[[], object]):
        self.app, self.timeout_s, self.on_timeout = app, timeout_s, on_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            messages = await asyncio.wait_for(_read_body(receive), self.timeout_s)
        except asyncio.TimeoutError:
            await self.on_timeout()(scope, receive, send)
            return
        pending = list(messages)

        async def replay():  # the body as received, then the live channel (disconnects)
            return pending.pop(0) if pending else await receive()
        await self.app(scope, replay, send)


async def _read_body(receive) -> list[dict]:
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown aborts what is still running after ``deadline_s`` (``abort_all``), cancels
    what still has not ended a few seconds later, then runs ``on_stopped`` (closing the engine: uvicorn re-raises
    the signal once it returns, so nothing after ``run`` may be relied on)."""

    GRACE_S = 5.0  # for aborted streams to send their last chunks

    def __init__(self, config: uvicorn.Config, deadline_s: float, abort_all: Callable[[], None],
                 on_stopped: Callable[[], None] = lambda: None):
        config.timeout_graceful_shutdown = deadline_s + self.GRACE_S
        super().__init__(config)
        self.deadline_s, self.abort_all, self.on_stopped = deadline_s, abort_all, on_stopped

    async def shutdown(self, sockets=None) -> None:
        async def deadline() -> None:
            await asyncio.sleep(self.deadline_s)
            log.warning("shutdown deadline (%.0f s) passed: aborting the requests still running", self.deadline_s)
            self.abort_all()
        timer = asyncio.create_task(deadline())
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            self.on_stopped()
