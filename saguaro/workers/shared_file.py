"""An anonymous in-memory file that a child process inherits by descriptor.

Used to hand a worker process (an SSD speculator, a tensor-parallel rank) its start-up payload, a
model's weights and the SSD channel's message counters without a pipe (which can block) or a named
file (which a crash would leave behind). Linux gives a ``memfd``; elsewhere an unlinked temporary file.
"""
from __future__ import annotations

import os
import tempfile


class SharedFile:
    """An anonymous file in memory that a child process inherits by descriptor (no name, no leftovers)."""

    def __init__(self, size: int = 0):
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("saguaro", 0)
        else:
            with tempfile.TemporaryFile() as f:
                fd = os.dup(f.fileno())
        os.set_inheritable(fd, True)
        if size:
            os.ftruncate(fd, size)
        self.fd = fd

    def path(self) -> str | None:
        """A path that re-opens the file (for mmap), where the OS offers one."""
        path = f"/proc/self/fd/{self.fd}"
        return path if os.path.exists(path) else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __getstate__(self) -> dict:
        return {"fd": self.fd}  # the child inherits the same descriptor number
