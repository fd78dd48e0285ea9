"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once: 7 GB of fp32 for
the 1.5B model. The format is simple (u64 header length, JSON header with byte offsets,
raw little-endian data), and a GGUF tells us every shape before we dequantize anything,
so we write the header first and then stream tensors through, holding one at a time.
Files are read back with the regular ``safetensors`` library (memory-mapped), except by ``read_streaming``:
rewriting a whole file in another dtype reads it with plain file reads, one tensor at a time, because the
pages of a mapping a process has read count as its resident memory until it unmaps the file (deriving the
0.5B's bf16 copy through a mapping peaked at 3.0 GB; read this way, what was read is page cache).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

# safetensors dtype codes for the dtypes we write
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise ValueError(f"cannot store {dtype} (supported: {', '.join(map(str, _CODES))})") from None


def write_streaming(path: Path, entries: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                    produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
                    progress: Iterable[int] | None = None) -> None:
    """Write ``entries`` (name, shape) in order; ``produce(name)`` returns each tensor when its turn comes.

    Every produced tensor must have the declared shape; it is cast to ``dtype``.
    ``progress`` is an optional tqdm-like object with ``update(n)``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    code = dtype_code(dtype)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, shape in entries:
        nbytes = itemsize
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in entries:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"tensor {name}: produced shape {tuple(tensor.shape)}, declared {tuple(shape)}")
            data = tensor.detach().to("cpu", dtype).contiguous()
            # bytes through a uint8 view: works for bf16, which numpy cannot represent
            if data.numel():
                f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            if progress is not None:
                progress.update(1)  # type: ignore[attr-defined]


def read_streaming(path: Path) -> tuple[list[tuple[str, tuple[int, ...]]], Callable[[str], torch.Tensor]]:
    """The (name, shape) entries of a safetensors file in file order, and ``read(name)``: that tensor, read
    from the file into memory of its own (the file is never mapped). Raises ValueError for a dtype other than
    those ``write_streaming`` writes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    start = 8 + n
    for name, entry in header.items():
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} is {entry['dtype']} (readable: {', '.join(_DTYPES)})")
    order = sorted(header, key=lambda name: header[name]["data_offsets"][0])

    def read(name: str) -> torch.Tensor:
        entry = header[name]
        begin, end = entry["data_offsets"]
        data = bytearray(end - begin)
        with open(path, "rb", buffering=0) as f:
            f.seek(start + begin)
            if f.readinto(data) != len(data):
                raise ValueError(f"{path}: tensor {name} is cut short (truncated file)")
        dtype = _DTYPES[entry["dtype"]]
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return flat.reshape(entry["shape"])

    return [(name, tuple(header[name]["shape"])) for name in order], read
