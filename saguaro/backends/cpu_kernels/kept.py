"""What the kernels measure once per CPU and keep: JSON files under ``<cache root>/cpu/`` (the read plan,
``stream_tune.py``; the row costs, ``row_costs.py``), keyed by the CPU's identity."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from saguaro.loading.paths import cache_root

log = logging.getLogger("saguaro.kernels")
T = TypeVar("T")


def path(name: str) -> Path:
    return cache_root() / "cpu" / name


def read(name: str) -> dict[str, Any]:
    """The kept values in ``name`` ({} when there are none, or the file cannot be read)."""
    try:
        values = json.loads(path(name).read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def keep(name: str, key: str, value: Any, usable: Callable[[Any], bool] = lambda kept: True) -> Any:
    """Keep ``value`` under ``key`` in ``name`` unless another process kept a ``usable`` one first; returns the
    one kept. The first measurement wins (under a lock, the file replaced atomically), so every process on this CPU
    reads the same values: a seeded request's K follows the row costs, and must not differ between two
    processes that measured at once. A read-only cache only warns: the value is measured again next time."""
    target = path(name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            values = read(name)
            if key in values and usable(values[key]):
                return values[key]
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**values, key: value}, indent=1))
            os.replace(tmp, target)
    except OSError as e:
        log.warning("could not keep %s in %s: %s", key, target, e)
    return value


def once(name: str, key: str, parse: Callable[[Any], T | None], measure: Callable[[], T],
         encode: Callable[[T], Any] = lambda value: value) -> T:
    """The value kept under ``key`` (``parse``: it, or None where it is missing, malformed or not enough), else
    ``measure()`` kept (``encode``: as JSON) -- or, where another process kept one meanwhile, that one."""
    value = parse(read(name).get(key))
    if value is None:
        measured = measure()
        value = parse(keep(name, key, encode(measured), usable=lambda other: parse(other) is not None))
        value = measured if value is None else value
    return value


def cpu_identity(cpuinfo: str | None = None) -> str:
    """The CPU's name with its family and model: a VM may show every AMD core as "AMD EPYC"."""
    if cpuinfo is None:
        try:
            cpuinfo = open("/proc/cpuinfo").read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() not in fields:
            fields[name.strip()] = value.strip()
    return " ".join(filter(None, [fields.get("model name") or fields.get("Model") or platform.machine(),
                                  fields.get("cpu family") and f"family {fields['cpu family']}",
                                  fields.get("model") and f"model {fields['model']}"]))
