"""The packed arena cached on disk and mapped: a later load maps the file instead of packing again.

Packing reads every weight once and writes every tile (2-5 s for the 1.5B, most of it faulting pages in). The
packed bytes depend only on the weights file, the format, the kernel tier and the head's rows, so the first load
stores them and every later load maps them: it costs about as long as touching the pages (the checksum reads
them all), the eager weights are never read, and two engines of one model on a machine share the pages through
the page cache. Weights that are not mapped from files (a model built in memory) are never cached.

What a cached load costs (the 1.5B, bf16, a shared 2-core Zen 4): 1.9 s of ``LLM(...)`` with the arena in the
page cache (0.6 s of it the checksum), 9.1 s with it read from disk (7.2 s the checksum: the disk read, which
the first forward pass would wait for anyway). So the whole checksum is verified on every load, not only a
header: skipping it would move the read, not save it, and a flipped byte would change outputs silently.
``MADV_WILLNEED`` asks the kernel to read the file ahead in large requests: 3x faster for a cold 278 MB arena
(0.14 s, not 0.40-0.49 s), no measurable change for the 1.5B's 2.9 GB (its pages map as huge pages already).

Where: ``<weights dir>/arenas/`` when the weights are in Saguaro's cache directory (a converted GGUF), else
``<cache root>/arenas/`` (an HF directory stays as its owner left it). ``SAGUARO_ARENA_CACHE=off`` turns it off.

A file is a 4096-byte header (JSON, NUL padded) and then the arena. The header holds the format version, the key
(each weights file's path, size and modification time; format; tier; head digest; length) and a checksum (the
sum of the arena's 64-bit words mod 2**64, so any changed byte changes it). A file of another version, another
key, the wrong size or a bad checksum is logged and packed again, never used. Writers write a temporary sibling
and rename it into place, so a reader sees a whole file or none; a lock lets one process at a time store a
given arena (another packing the same model at once uses its own arena and stores nothing).

The store runs in a background thread (``store_in_background``) once the arena is packed: the load returns at
once instead of waiting for 3 GB to be checksummed and written (for the 1.5B that doubled a first load). The
arena is never written after packing, so the thread reads it while the engine runs. The thread is not a
daemon: the interpreter finishes the store before it exits. A process killed meanwhile leaves only its
temporary, which no reader opens and the next store removes.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from saguaro.host_memory import MADV_HUGEPAGE, MADV_WILLNEED, advise
from saguaro.loading.paths import cache_root, remove_dead_temporaries

log = logging.getLogger("saguaro.fast")
ARENA_VERSION = 1
HEADER = 4096
ENV = "SAGUARO_ARENA_CACHE"
_stores: list[threading.Thread] = []  # background stores not yet joined


@dataclass(frozen=True)
class ArenaKey:
    sources: tuple[tuple[str, int, int], ...]  # each weights file: path, size, mtime_ns
    weights: str
    tier: str
    head: str  # "all" rows, or a digest of the kept token ids
    nbytes: int

    def as_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))  # tuples as lists, as a header reads back

    def path(self) -> Path:
        root = cache_root()
        first = Path(self.sources[0][0])
        directory = first.parent / "arenas" if first.is_relative_to(root) else root / "arenas"
        digest = hashlib.sha256(json.dumps([s[0] for s in self.sources]).encode()).hexdigest()[:12]
        return directory / f"{first.parent.name}-{digest}.{self.weights}.{self.tier}.{self.head}.arena"


def key_for(paths: list[str | None], weights: str, tier: str, head_ids: torch.Tensor | None,
            nbytes: int) -> ArenaKey | None:
    """The key of an arena packed from weights mapped from ``paths`` (one per parameter; None: in memory)."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "false", "no") or not paths or None in paths:
        return None
    try:
        sources = tuple((p, (st := os.stat(p)).st_size, st.st_mtime_ns) for p in sorted(set(paths)))
    except OSError:
        return None
    head = "all" if head_ids is None else hashlib.sha256(head_ids.numpy().tobytes()).hexdigest()[:12]
    return ArenaKey(sources, weights, tier, head, nbytes)


def checksum(buffer: torch.Tensor) -> int:
    """Sum of the 64-bit words of a uint8 tensor (its tail zero padded), mod 2**64."""
    data = buffer.numpy()
    whole = len(data) // 8 * 8
    total = int(np.add.reduce(data[:whole].view(np.uint64), dtype=np.uint64)) if whole else 0
    tail = int.from_bytes(data[whole:].tobytes().ljust(8, b"\0"), "little") if whole < len(data) else 0
    return (total + tail) % (1 << 64)


def load(key: ArenaKey) -> torch.Tensor | None:
    """The cached arena mapped from its file, or None (absent, or unusable: logged)."""
    path = key.path()
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(HEADER).rstrip(b"\0"))
        if header.get("version") != ARENA_VERSION:
            problem = f"format version {header.get('version')}, not {ARENA_VERSION}"
        elif header.get("key") != key.as_dict():
            problem = "stale (the weights, format, tier or head differ)"
        elif path.stat().st_size != HEADER + key.nbytes:
            problem = f"{path.stat().st_size} bytes, not {HEADER + key.nbytes} (partial)"
        else:
            data = torch.from_file(str(path), shared=False, size=HEADER + key.nbytes, dtype=torch.uint8)[HEADER:]
            advise(data, MADV_HUGEPAGE)  # where the kernel maps file pages huge
            advise(data, MADV_WILLNEED)  # a file not in the page cache is read ahead in large requests
            if checksum(data) == header.get("checksum"):
                log.info("mapped the packed %s arena from %s", key.weights, path)
                return data
            problem = "bad checksum (corrupted)"
    except (OSError, ValueError, RuntimeError, AttributeError) as e:
        problem = f"unreadable ({e})"
    log.warning("packed arena cache %s: %s; packing again", path, problem)
    return None


def store(key: ArenaKey, buffer: torch.Tensor) -> None:
    """Write ``buffer`` (a uint8 arena) as ``key``'s file, unless another process is writing it now."""
    path = key.path()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return  # another process is storing this arena
                raise
            remove_dead_temporaries(path.parent, f".{path.name}.tmp-")
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            header = json.dumps({"version": ARENA_VERSION, "key": key.as_dict(), "checksum": checksum(buffer)})
            if len(header) > HEADER:
                raise OSError(f"a header of {len(header)} bytes (its weights files' names are too long)")
            with open(tmp, "wb") as f:
                _write(f, header.encode().ljust(HEADER, b"\0"), buffer)
            os.replace(tmp, path)
            log.info("stored the packed %s arena in %s", key.weights, path)
    except OSError as e:  # a read-only or full disk: this load keeps its arena, the next packs again
        log.warning("could not store the packed arena in %s: %s", path, e)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _write(f, header: bytes, buffer: torch.Tensor) -> None:
    f.write(header)
    f.write(memoryview(buffer.numpy()))


def store_in_background(key: ArenaKey, buffer: torch.Tensor) -> threading.Thread:
    """``store`` from a thread, so the load that packed ``buffer`` returns without waiting for the write."""
    thread = threading.Thread(target=store, args=(key, buffer), name="saguaro-arena-store")
    thread.start()
    _stores[:] = [t for t in _stores if t.is_alive()] + [thread]
    return thread


def wait_for_stores(timeout: float | None = None) -> None:
    """Join the background stores this process started (a test, or a caller about to read the files)."""
    for thread in list(_stores):
        thread.join(timeout)
