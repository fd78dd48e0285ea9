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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def remove_dead_temporaries(directory: Path, prefix: str) -> None:
    """Delete ``<prefix><pid>-…`` entries left by processes that were killed mid-write.

    Temporaries carry their writer's pid, so a live writer's files are never touched;
    without this a SIGKILLed 1.5B conversion would leave 7 GB behind for good.
    """
    import shutil

    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
