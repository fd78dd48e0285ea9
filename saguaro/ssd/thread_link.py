"""The colocated speculator: the same ``Speculator`` in a thread of the target's process.

It starts and serves exactly as the speculator process does (``host.py``): take a request,
respond, then build the next cache while the target verifies, and cut the build short as soon
as the next request is waiting. Only the transport differs: requests and responses pass as Python
objects through two in-process queues, with no packing. Ownership passes with the message:
the decoder builds a fresh ``RoundRequest`` every round and never touches it after sending,
and the speculator never touches a response's rows after sending them.

Where the thread runs (its "lane"):
  * CPU: the thread pins itself to ``opts.cores`` (``sched_setaffinity(0, ...)`` called in a
    thread sets that thread's mask only, on Linux) and uses ``opts.threads`` torch threads.
    It shares the interpreter lock with the target, so the Python parts of a build and of a
    verification take turns; the torch kernels themselves release the lock and overlap.
  * GPU: the thread launches on a CUDA stream of its own, optionally inside a green context
    holding ``sms`` of the GPU's SMs (``torch.cuda.green_contexts``, where the installed torch
    has it with ``GreenContext.Stream``; elsewhere it warns and shares all SMs). Attention sizes
    its split count to the lane's SMs. Each response carries a CUDA event recorded on that stream after ``respond``;
    the target's stream waits on it before reading the response's device tensors; and a request carrying an
    EAGLE-3 head's target features carries an event recorded on the target's stream after they were written,
    which the speculator's stream waits on before copying them (``eagle.features.cross_fence``). The target's
    rounds run on a stream of the highest priority, the speculator's of the lowest (``stream_priority.py``).
    Priorities and the green context are as the overlap probe found best on this card (``lane_profile.py``;
    ``SAGUARO_STREAM_PRIORITIES`` and ``SAGUARO_SPECULATOR_SMS`` override it). No NCCL.

Failure never hangs the target: an exception in the thread travels to the next ``exchange``,
and a thread that does not answer within ``opts.timeout_s`` is given up on; both raise
``ChannelClosed``, so the decoder falls back to n-gram SD in the target and loses nothing. A
Python thread cannot be killed: ``kill`` asks it to stop at its next chance and leaves it to
finish as a daemon.
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from saguaro.backends.paged.attention_triton import lane_sm_count
from saguaro.eagle.features import cross_fence, fence_features
from saguaro.ssd.channel import ChannelClosed
from saguaro.ssd.host import SpeculatorOptions, serve, start_speculator
from saguaro.ssd.protocol import CMD_STOP, RoundRequest, RoundResponse
from saguaro.ssd.lane_profile import resolve_lanes
from saguaro.ssd.stream_priority import LanePriorities, TargetLane, lane_priorities

log = logging.getLogger("saguaro.ssd")

STOP_GRACE_S = 10.0  # how long ``stop`` waits for a build to notice the stop request and the thread to close

# The interpreter's switch interval while a speculator thread runs. A thread that wants the interpreter lock
# waits this long before asking the holder to yield it; at Python's default (5 ms) the target, coming back from
# each GPU sync of a verification, waits behind the speculator's Python build for up to 5 ms: a verification
# beside the build took 2.2x its time alone on an H200. SAGUARO_SWITCH_INTERVAL_S overrides it (0: leave
# the interpreter's own).
SWITCH_INTERVAL_S = float(os.environ.get("SAGUARO_SWITCH_INTERVAL_S", "0.0002"))


@dataclass
class _Reply:
    """Speculator -> target: a response, the ready signal (``response`` None) or the thread's exception."""
    response: RoundResponse | None = None
    error: BaseException | None = None
    event: Any = None  # GPU: a torch.cuda.Event recorded on the speculator's stream after ``respond``


class ThreadLink:
    """The engine's handle on a speculator thread (the ``SpeculatorLink`` protocol)."""

    def __init__(self, draft: Any, opts: SpeculatorOptions, sms: int | None = None):
        """``sms``: a green context of that many SMs for the speculator, over the probe's verdict."""
        self.opts = opts
        self.requests: queue.SimpleQueue[RoundRequest] = queue.SimpleQueue()
        self.replies: queue.SimpleQueue[_Reply] = queue.SimpleQueue()
        self.stopping = threading.Event()  # set by stop/kill: builds end at their next step, the loop exits
        self.lanes = resolve_lanes(opts.device)  # the probe's verdict for this card, or the default; reported
        sms = self.lanes.sms if sms is None else sms
        self._switch = _SwitchInterval.hold()
        # GPU: the target's rounds first, the build in what is left
        priorities = lane_priorities(opts.device, on=self.lanes.priorities)
        self.target_lane = TargetLane(opts.device, priorities)
        self.thread = threading.Thread(target=self._serve, args=(draft, sms, priorities), daemon=True,
                                       name="saguaro-speculator")
        self.thread.start()
        try:  # the thread places the draft and sets up its lane first; a failure there is a start-up error
            self._receive(max(opts.timeout_s, 600.0))
        except ChannelClosed as e:
            self.kill()
            raise RuntimeError(f"speculator thread failed during start-up: {e}") from e.__cause__

    # -- the target's side -------------------------------------------------------
    def post(self, request: RoundRequest) -> None:
        self._check_alive()
        request.fence = fence_features(request.feature_tensors())
        self.requests.put(request)

    def exchange(self, request: RoundRequest) -> RoundResponse:
        self._check_alive()
        request.fence = fence_features(request.feature_tensors())
        self.requests.put(request)
        return self._receive(self.opts.timeout_s)

    def stop(self) -> None:
        """Ask the thread to finish (a build in progress ends at its next step) and join it."""
        self.stopping.set()
        self.requests.put(RoundRequest(command=CMD_STOP))
        self.thread.join(timeout=STOP_GRACE_S)
        self._switch.release()
        if self.thread.is_alive():
            log.warning("speculator thread did not stop within %.0f s; left to finish as a daemon", STOP_GRACE_S)

    def kill(self) -> None:
        """Give up on the thread without waiting for it: it stops at its next step or request."""
        self.stopping.set()
        self.requests.put(RoundRequest(command=CMD_STOP))
        self._switch.release()

    def _check_alive(self) -> None:
        if self.stopping.is_set():
            raise ChannelClosed("the speculator thread was stopped")
        if not self.thread.is_alive():
            try:  # it died raising: say why
                self._raise_if_error(self.replies.get_nowait())
            except queue.Empty:
                pass
            raise ChannelClosed("the speculator thread is gone")

    def _receive(self, timeout_s: float) -> RoundResponse | None:
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ChannelClosed(f"no response from the speculator thread within {timeout_s:.1f} s") from None
        self._raise_if_error(reply)
        if reply.event is not None:
            _receive_on_stream(reply, torch.device(self.opts.device))
        return reply.response

    @staticmethod
    def _raise_if_error(reply: _Reply) -> None:
        if reply.error is not None:
            raise ChannelClosed(f"the speculator thread raised {type(reply.error).__name__}: {reply.error}"
                                ) from reply.error

    # -- the speculator's side (runs in the thread) ------------------------------
    def _serve(self, draft: Any, sms: int | None, priorities: LanePriorities | None) -> None:
        opts = self.opts
        try:
            with _lane(opts, sms, priorities, self._green_refused) as stream, torch.no_grad():  # grad: per thread
                speculator = start_speculator(draft, opts)
                self.replies.put(_Reply())  # ready
                serve(speculator, self._next_request,
                      lambda response: self.replies.put(_Reply(response, event=_handoff_event(stream))),
                      lambda: self.stopping.is_set() or not self.requests.empty())
        except BaseException as e:  # handed to the target's next exchange
            log.error("speculator thread raised %s: %s", type(e).__name__, e, exc_info=True)
            self.replies.put(_Reply(error=e))

    def _green_refused(self) -> None:
        """The lane asked for a green context and shares all SMs instead (logged there): report what runs."""
        self.lanes = replace(self.lanes, sms=None, detail=f"{self.lanes.detail}; no green context here, all SMs")

    def _next_request(self) -> RoundRequest | None:
        req = self.requests.get()
        if self.stopping.is_set():
            return None
        cross_fence(req.fence, req.feature_tensors())  # the target's features are written before they are copied
        return req


class _SwitchInterval:
    """The interpreter's switch interval lowered to ``SWITCH_INTERVAL_S`` while any thread link holds it, and
    restored when the last one releases it (the setting is process-wide)."""
    _lock = threading.Lock()
    _holders = 0
    _saved = 0.0

    def __init__(self) -> None:
        self.held = True

    @classmethod
    def hold(cls) -> _SwitchInterval:
        with cls._lock:
            if cls._holders == 0:
                cls._saved = sys.getswitchinterval()
                if 0 < SWITCH_INTERVAL_S < cls._saved:
                    sys.setswitchinterval(SWITCH_INTERVAL_S)
            cls._holders += 1
        return cls()

    def release(self) -> None:
        with self._lock:
            if not self.held:
                return  # stop after kill, or twice
            self.held = False
            type(self)._holders -= 1
            if self._holders == 0:
                sys.setswitchinterval(self._saved)


@contextmanager
def _lane(opts: SpeculatorOptions, sms: int | None, priorities: LanePriorities | None = None,
          green_refused: Callable[[], None] = lambda: None) -> Iterator[Any]:
    """Run the body on the speculator's lane; yields its CUDA stream (None on the CPU), of the speculator's
    priority where ``priorities`` are set (a green context's stream keeps the default, the lowest).
    ``green_refused`` is called where ``sms`` asked for a green context and none could be had."""
    if opts.device == "cpu":
        if opts.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(opts.cores))  # pid 0 from a thread: this thread only (Linux)
        torch.set_num_threads(opts.threads)
        yield None
        return
    # ---- GPU lane. Written for torch >= 2.9 with CUDA; checked on the CPU only (tests/test_ssd_lane.py). ----
    device = torch.device(opts.device)
    torch.cuda.set_device(device)  # the current device is per thread
    green = _green_context(device, sms)
    if sms and green is None:
        green_refused()
    try:
        # a stream of the thread's own, never the one set_context made current: the caching allocator keys
        # its pools by stream, and would take that one for the target's
        low = {} if priorities is None else {"priority": priorities.speculator}
        stream = green.Stream() if green is not None else torch.cuda.Stream(device, **low)
        lane_sm_count(sms if green is not None else None)  # attention splits sized to the lane's SMs
        with torch.cuda.stream(stream):  # the current stream is per thread too: the target's is untouched
            yield stream
    finally:
        lane_sm_count(None)
        if green is not None:
            green.pop_context()


# One green context per (device, SMs), made on first use and never destroyed. torch's GreenContext destructor
# calls cuGreenCtxDestroy inside a noexcept destructor: on torch 2.11 (H200) a lane's green context collected
# after its SSD run aborted the whole process, since the side streams torch made for it (and never destroys),
# and the graphs and events recorded on them, outlive it. Kept alive here like those streams; the extra
# reference taken at creation keeps interpreter shutdown from destroying it too.
_GREEN_CONTEXTS: dict[tuple[int, int], Any] = {}
_GREEN_LOCK = threading.Lock()


def _green_context(device: torch.device, sms: int | None) -> Any:
    """GPU: a green context holding ``sms`` SMs, made current for this thread; None if not asked for, unavailable,
    or without ``GreenContext.Stream`` (some torch releases): the lane then shares all SMs, on its own stream.
    Lanes asking for the same share get the same context (each takes a stream of its own from it)."""
    if not sms:
        return None
    try:
        from torch.cuda.green_contexts import GreenContext
        if not hasattr(GreenContext, "Stream"):
            raise AttributeError(f"torch {torch.__version__} has no GreenContext.Stream")
        key = (device.index or 0, sms)
        with _GREEN_LOCK:
            green = _GREEN_CONTEXTS.get(key)
            if green is None:
                green = GreenContext.create(num_sms=sms, device_id=key[0])
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(green))  # immortal: never reaches the destructor
                _GREEN_CONTEXTS[key] = green
        green.set_context()
        return green
    except (ImportError, RuntimeError, TypeError, AttributeError) as e:
        log.warning("no green context of %d SMs on %s (%s); the speculator shares all SMs on a stream of its own",
                    sms, device, e)
        return None


def _handoff_event(stream: Any) -> Any:
    """GPU: an event marking the end of ``respond``'s work on the speculator's stream."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _receive_on_stream(reply: _Reply, device: torch.device) -> None:
    """GPU, target side: order the target's stream after the response's producer, and tell the caching
    allocator the response's device tensors are now used there (else their memory could be handed back
    to the speculator's stream while the target still reads it)."""
    consumer = torch.cuda.current_stream(device)
    reply.event.wait(consumer)
    for row in reply.response.rows:
        for t in (row.probs, row.device_tokens):
            if t is not None and t.is_cuda:
                t.record_stream(consumer)
