"""Host memory pages: what a process holds resident, allocating without touching, and handing mapped pages back.

Resident memory (RSS) counts every page a process has touched: anonymous pages it wrote and the pages
of files it maps and read. Two consequences shape how Saguaro holds weights and caches:

* Weights loaded from safetensors are private mappings of the file. Reading them (packing them
  for the CPU kernels) makes them resident, but no copy is made: ``release_mapped`` hands the
  pages of tensors that are never written back to the page cache (``MADV_DONTNEED``), and a later
  read faults them in again from the file, unchanged. Anonymous memory (a model built in memory, a
  cast at load) is never released: its pages are its only copy.
* ``lazy_zeros`` allocates zeroed memory whose pages the kernel fills on first touch (an anonymous
  mapping), so a KV cache costs the blocks requests write, not its capacity; ``torch.zeros`` writes
  every page at allocation.

Linux only (``/proc``, ``madvise``); elsewhere nothing is released and ``lazy_zeros`` is
``torch.zeros``.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_WILLNEED = 3  # read the range ahead, asynchronously, in large requests
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
_LINUX = os.path.exists("/proc/self/smaps")


def resident_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (``/proc/<pid>/statm``), in bytes; 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    path: str


def _clean_file_mappings() -> list[_Mapping]:
    """File mappings whose pages all equal the file's (shared, or private without copied-on-write pages), so
    dropping their resident pages loses nothing: a later read refills them from the file."""
    found: list[_Mapping] = []
    current: tuple[int, int, str, bool] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                path = head[5].strip() if len(head) > 5 else ""
                shared = head[1][3] == "s"
                current = (start, end, path, shared)
            elif head[0] == "Anonymous:" and current is not None:
                start, end, path, shared = current
                if path.startswith("/") and not path.startswith(("/dev/zero", "/memfd:", "/SYSV")) \
                        and (shared or int(head[1]) == 0):
                    if found and found[-1].end == start and found[-1].path == path:  # one mapping, advised in parts
                        start = found.pop().start
                    found.append(_Mapping(start, end, path))
                current = None
    return found


class MappedPages:
    """The clean file mappings of this process at construction; ``release`` drops tensors' pages in them."""

    def __init__(self):
        self.mappings = _clean_file_mappings() if _LINUX else []
        self.starts = [m.start for m in self.mappings]
        self.released = 0  # bytes handed back

    def path(self, tensor: torch.Tensor) -> str | None:
        """The file whose clean mapping holds all of ``tensor``'s bytes, or None."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return None
        first = tensor.data_ptr()
        i = bisect.bisect_right(self.starts, first) - 1
        inside = i >= 0 and first + tensor.numel() * tensor.element_size() <= self.mappings[i].end
        return self.mappings[i].path if inside else None

    def mapped(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in one clean file mapping."""
        return self.path(tensor) is not None

    def release(self, *tensors: torch.Tensor) -> None:
        """Drop the resident pages wholly inside each mapped, contiguous tensor (the edge pages, which a
        neighbour may be using, stay)."""
        for t in tensors:
            if t.is_contiguous() and self.mapped(t):
                self.released += advise(t, MADV_DONTNEED)


def advise(tensor: torch.Tensor, advice: int) -> int:
    """``madvise`` the pages wholly inside a contiguous CPU tensor; the bytes advised (0 on failure)."""
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    if not _LINUX or end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return end - start if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0 else 0


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc ``malloc_trim``): a quantized pack frees its
    temporaries in pieces the heap would otherwise keep resident (0.9 GB after packing the 1.5B in int4)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages become resident only when written (or read): an anonymous mapping,
    which the kernel fills with zero pages on demand."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if not _LINUX or nbytes < 1 << 20:  # small: not worth a mapping of its own
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=torch.Size(shape).numel()).view(shape)
