"""Where Saguaro keeps derived files: assembled GGUFs, converted models, hash records.

Default ``~/.cache/saguaro``; the ``SAGUARO_CACHE`` environment variable overrides it
(tests point it at a temporary directory; shared machines can point it at a big disk).
Read on every call, not at import, so a changed environment takes effect immediately.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SAGUARO_CACHE"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "saguaro"
