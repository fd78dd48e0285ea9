"""A real ``saguaro serve`` on loopback for tests (not a test file): uvicorn on a free port, in a thread."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

uvicorn = pytest.importorskip("uvicorn")  # the server's packages: absent on the GPU machine

from saguaro.server.in_thread import InThread, serve_in_thread  # noqa: E402
from saguaro.server.lifecycle import ServerLimits  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t9{% endif %}")


def chat_model(seed: int = 1, **kwargs):
    """A tiny random model whose tokenizer has a chat template (messages joined, then "t9")."""
    loaded = tiny_model(seed=seed, **kwargs)
    loaded.tokenizer.chat_template = CHAT_TEMPLATE
    return loaded


@dataclass
class Served(InThread):
    """The server in a thread, with what the tests ask of it."""

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def free_blocks(self) -> tuple[int, int]:
        blocks = self.engine.llm.engine.target.blocks
        return blocks.num_free, blocks.num_blocks

    def idle(self, timeout_s: float = 30) -> bool:
        """Wait (bounded) until the engine holds no request and every KV block is free again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            free, total = self.free_blocks()
            if free == total and not self.engine.llm.engine.has_unfinished:
                return True
            time.sleep(0.02)
        return False


@contextmanager
def running_server(llm, name: str = "tiny", api_key: str | None = None, limits: ServerLimits = ServerLimits()):
    with serve_in_thread(llm, name, api_key, limits, start_timeout_s=30) as s:
        yield Served(s.url, s.engine, s.server)


def http(url: str, body: bytes | dict | None = None, headers: dict | None = None) -> tuple[int, str]:
    """GET (no body) or POST; the status and body text, errors included."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
