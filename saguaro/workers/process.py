"""Start a worker process (the SSD speculator, a tensor-parallel rank) so that no start-up failure can leave
the engine waiting.

A ``multiprocessing`` spawn can hang a start-up in three ways: the child re-imports the parent's
``__main__`` (impossible for a script on stdin or ``python -c``, so it dies); arguments pickled
through the start pipe block ``Process.start()`` once the pipe is full and the child is dead (the
parent itself still holds the pipe's read end); and a wait that watches only a socket or an event
never learns that the child is gone. So here:

  * the worker is a fresh interpreter running ``child_main`` of this module: it imports only
    saguaro, never the parent's main module;
  * nothing big travels through a pipe. The start-up payload and a model's weights go into
    anonymous in-memory files (``memfd``) that the child inherits by descriptor; a model given by
    registry name or path travels as that string and the child loads it itself (``shipment.py``);
  * every wait of the parent watches the child (``WorkerProcess.expect``): if it exits, the
    parent raises at once with how it ended, the tail of its stderr and what to do.

Glossary:
  payload   the pickled (function, args) the child runs; args may hold ``Shipment``s and
            ``SharedFile``s, which re-open their descriptors in the child.
  role      how errors name the worker: "SSD speculator", "tensor-parallel rank 1"
  hint      what to do when it fails, which its starter knows
  tail      the last lines the child wrote to stderr (also forwarded to ours as they come).
"""
from __future__ import annotations

import collections
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

from saguaro.workers.shared_file import SharedFile

T = TypeVar("T")
_TAIL_LINES = 30
_parent_pid: int | None = None  # set in the worker by child_main


class WorkerStartError(RuntimeError):
    """A worker process died or went silent before it was ready."""


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous store between the engine and its workers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """A running worker interpreter: its liveness, how it ended, and its stderr tail."""

    def __init__(self, target: Callable[..., None], args: tuple, keep: list[SharedFile | None], role: str,
                 hint: str, killed_hint: str | None = None):
        self.role = role  # how errors name it: "SSD speculator", "tensor-parallel rank 1"
        self.hint = hint  # what to do when it fails
        self.killed_hint = killed_hint or hint  # what to do when a signal ended it (often: out of memory)
        payload = SharedFile()
        with os.fdopen(os.dup(payload.fd), "wb") as f:
            pickle.dump((target, args), f)
        fds = [payload.fd] + [s.fd for s in keep if s is not None]
        code = f"from saguaro.workers.process import child_main; child_main({payload.fd}, {os.getpid()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=_child_env())
        payload.close()  # the child holds its own copy of the descriptor
        self.pid = self.proc.pid
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._forwarder = threading.Thread(target=self._forward, name=f"saguaro-{role}-stderr", daemon=True)
        self._forwarder.start()
        weakref.finalize(self, _kill, self.proc)  # at interpreter exit at the latest, the worker goes too

    def _forward(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            try:
                sys.stderr.write(line)
            except (ValueError, OSError):  # our stderr was closed (interpreter shutting down)
                pass

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        _kill(self.proc)

    def how_it_ended(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "it is still running but did not answer"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return f"it was killed by signal {-code} ({name})"
        return f"it exited with code {code}"

    def failure(self, stage: str, hint: str | None = None) -> WorkerStartError:
        """A start-up error that says what happened, shows the child's last words and what to do."""
        code = self.proc.poll()
        if code is not None:
            self._forwarder.join(1.0)  # its stderr ends with it: take its last lines
        hint = hint or (self.killed_hint if code is not None and code < 0 else self.hint)
        tail = "".join(self.tail).rstrip()
        shown = f"\n--- {self.role} stderr (last lines) ---\n{tail}\n---" if tail else ""
        return WorkerStartError(f"the {self.role} process failed while {stage}: {self.how_it_ended()}.{shown}\n"
                                f"What to do: {hint}.")

    def expect(self, stage: str, wait: Callable[[], T], timeout_s: float) -> T:
        """Run ``wait`` (which may block) on a helper thread; raise at once if the child dies or time runs out."""
        return expect_all([self], stage, wait, timeout_s)


def expect_all(procs: list[WorkerProcess], stage: str, wait: Callable[[], T], timeout_s: float) -> T:
    """``WorkerProcess.expect`` watching several children: the first that dies, or the time running out, raises."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(("ok", wait()))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller below
            result.append(("error", e))

    thread = threading.Thread(target=run, name=f"saguaro-worker-{stage}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(0.05)
        if not thread.is_alive():
            break
        dead = next((p for p in procs if not p.is_alive()), None)
        if dead is not None:
            raise dead.failure(stage)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise procs[0].failure(stage, f"it did not finish {stage} within {timeout_s:.0f} s; raise "
                                          "worker_timeout_s if the machine is just slow or busy")
    kind, value = result[0]
    if kind == "error":
        dead = next((p for p in procs if not p.is_alive()), None)
        if dead is not None:
            raise dead.failure(stage) from value
        raise value
    return value


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _child_env() -> dict[str, str]:
    """Our environment, with our import path (the child must import saguaro and unpickle what we send)."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def child_main(payload_fd: int, parent_pid: int) -> None:
    """The worker interpreter's entry point: run the pickled (function, args) from the payload file."""
    with os.fdopen(payload_fd, "rb") as f:
        f.seek(0)  # the parent wrote it through a shared file offset
        target, args = pickle.load(f)
    global _parent_pid
    _parent_pid = parent_pid
    target(*args)


def parent_alive() -> bool:
    """In the worker: is the engine that started us still there? (An orphan must exit, not poll forever.)"""
    return _parent_pid is None or os.getppid() == _parent_pid
