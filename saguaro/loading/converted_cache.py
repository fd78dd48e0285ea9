"""A GGUF converted once into a directory that later loads in about a second.

Layout of ``<cache root>/<key>/`` (root: ``~/.cache/saguaro`` or ``$SAGUARO_CACHE``; key: the
registry name, or ``<file stem>-<sha256[:12]>`` for any other GGUF file):

* ``model.safetensors``   every tensor dequantized to **float32**, HF parameter names
* ``model.<dtype>.safetensors``   derived on first load in another dtype (e.g. bfloat16)
* ``config.json``         ``ModelConfig.to_dict()``
* ``tokenizer.json``      fast-tokenizer file converted from the GGUF vocabulary
* ``chat_template.jinja`` the GGUF's ``tokenizer.chat_template`` (absent if it has none)
* ``source.json``         source path, size and sha256, format version; written last

Why float32: every GGML quant (Q4_K, Q6_K, Q4_1, Q8_0, …) decodes to fp32 exactly, while
bf16 or fp16 cannot hold ``scale * q - min`` exactly, so only fp32 reproduces the GGUF
model bit for bit (what the fp32 parity tests against transformers need). The cost is disk:
7.1 GB for the 1.5B, 2.5 GB for the 0.5B. Loading does not pay for it: safetensors files
are memory-mapped, and when the requested dtype matches the file the tensors are used in
place. Measured on the 2-core dev machine: converting the 1.5B takes ~50 s once; a later
fp32 load takes 0.3-1.3 s (warm page cache). Serving in bf16 would otherwise cast 7 GB on
every start, so the first bf16 load writes a bf16 copy next to the fp32 file (~10 s once)
and later bf16 loads map that copy instead (0.3 s).

A cache whose ``source.json`` names a different sha256 or format version is stale and
rebuilt. Conversion happens in a temporary sibling directory that is renamed into place
only when complete, so a killed conversion never leaves a half cache behind (and the
temporaries of writers that died are swept on the next conversion).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
import uuid
from pathlib import Path

import torch
from tqdm import tqdm

from saguaro.loading.gguf_loader import convert_tokenizer, open_gguf
from saguaro.loading.paths import cache_root, remove_dead_temporaries
from saguaro.loading.safetensors_stream import read_streaming, write_streaming

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
SOURCE_FILE = "source.json"


def cache_key(gguf_path: Path, sha256: str, name: str | None = None) -> str:
    return name if name else f"{gguf_path.stem}-{sha256[:12]}"


def cache_dir(key: str) -> Path:
    return cache_root() / key


def is_converted_dir(directory: Path) -> bool:
    return (directory / SOURCE_FILE).is_file() and (directory / "config.json").is_file()


def source_info(directory: Path) -> dict | None:
    try:
        return json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _complete(weights: Path) -> bool:
    """True when the safetensors file is as long as its header says (catches truncation cheaply)."""
    try:
        size = weights.stat().st_size
        with open(weights, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                return False
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, struct.error):
        return False


def is_fresh(directory: Path, sha256: str) -> bool:
    info = source_info(directory)
    return (info is not None and info.get("format_version") == FORMAT_VERSION
            and info.get("sha256") == sha256
            and all((directory / f).is_file() for f in ("config.json", "tokenizer.json"))
            and _complete(directory / WEIGHTS_FILE))


def convert(gguf_path: Path, directory: Path, sha256: str, progress: bool = True) -> None:
    """Dequantize ``gguf_path`` into ``directory`` (replacing a stale one atomically)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(directory.parent, f".{directory.name}.tmp-")
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        start = time.perf_counter()
        model = open_gguf(gguf_path)
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
        if model.chat_template:
            (tmp / "chat_template.jinja").write_text(model.chat_template)
        convert_tokenizer(gguf_path, tmp / "tokenizer.json")
        shapes = model.shapes()
        with tqdm(total=len(shapes), desc=f"converting {gguf_path.name}", unit="tensor",
                  disable=not progress) as bar:
            write_streaming(tmp / WEIGHTS_FILE, shapes, torch.float32, model.tensor,
                            metadata={"format": "pt"}, progress=bar)
        info = {"format_version": FORMAT_VERSION, "source": str(gguf_path), "sha256": sha256,
                "size": gguf_path.stat().st_size, "dtype": "float32",
                "conversion_seconds": round(time.perf_counter() - start, 1)}
        (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=2))
        _publish(tmp, directory, sha256)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path, sha256: str) -> None:
    try:
        os.rename(tmp, final)  # atomic; fails if ``final`` exists and is not empty
        return
    except OSError:
        pass
    if is_fresh(final, sha256):
        return  # another process finished the same conversion first; keep theirs
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def ensure_converted(gguf_path: Path, sha256: str, name: str | None = None,
                     progress: bool = True) -> tuple[Path, bool]:
    """The converted directory for this GGUF, and whether it was already there (a cache hit)."""
    directory = cache_dir(cache_key(gguf_path, sha256, name))
    if is_fresh(directory, sha256):
        return directory, True
    convert(gguf_path, directory, sha256, progress)
    return directory, False


def weights_file(directory: Path, dtype: torch.dtype, progress: bool = True) -> str:
    """Name of a weights file in ``dtype`` inside ``directory``, deriving it from fp32 if needed."""
    if dtype == torch.float32:
        return WEIGHTS_FILE
    label = str(dtype).removeprefix("torch.")
    name = f"model.{label}.safetensors"
    target = directory / name
    if _complete(target):
        return name
    remove_dead_temporaries(directory, f".{name}.tmp-")
    tmp = directory / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        shapes, read = read_streaming(directory / WEIGHTS_FILE)  # read, not mapped: see safetensors_stream.py
        with tqdm(total=len(shapes), desc=f"writing {label} copy", unit="tensor", disable=not progress) as bar:
            write_streaming(tmp, shapes, dtype, read, metadata={"format": "pt"}, progress=bar)
        os.replace(tmp, target)
    except OSError:
        # read-only cache: fall back to casting at load time
        tmp.unlink(missing_ok=True)
        return WEIGHTS_FILE
    return name
