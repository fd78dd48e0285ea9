"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once: 7 GB of fp32 for
the 1.5B model. The format is simple (u64 header length, JSON header with byte offsets,
raw little-endian data), and a GGUF tells us every shape before we dequantize anything,
so we write the header first and then stream tensors through, holding one at a time.
Files are read back with the regular ``safetensors`` library (memory-mapped).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

# safetensors dtype codes for the dtypes we write
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


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
