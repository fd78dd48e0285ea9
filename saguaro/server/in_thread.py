"""``saguaro serve``'s app over an ``LLM`` in a thread of this process, on a free loopback port: what the client
benchmarks and the tests talk to (``saguaro serve`` runs the same app in the foreground)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from saguaro.server.app import create_app
from saguaro.server.async_engine import AsyncEngine
from saguaro.server.lifecycle import GracefulServer, ServerLimits
from saguaro.workers.process import free_port


@dataclass
class InThread:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncEngine
    server: GracefulServer  # ``server.should_exit = True`` is what SIGTERM does


@contextmanager
def serve_in_thread(llm, name: str, api_key: str | None = None, limits: ServerLimits = ServerLimits(),
                    start_timeout_s: float = 60.0) -> Iterator[InThread]:
    """Serve ``llm`` as ``name`` until the block ends, then stop the server (gracefully) and close the engine."""
    engine, port = AsyncEngine(llm), free_port()
    server = GracefulServer(uvicorn.Config(create_app(engine, name, api_key, limits), host="127.0.0.1", port=port,
                                           log_level="warning"), limits.shutdown_timeout_s, engine.abort_all)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        if not server.started:
            raise RuntimeError("the server did not start")
        yield InThread(f"http://127.0.0.1:{port}", engine, server)
    finally:
        server.should_exit = True
        thread.join(timeout=limits.shutdown_timeout_s + 2 * GracefulServer.GRACE_S)
        engine.close()
