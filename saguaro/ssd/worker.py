"""The speculator process: its own device, its own draft model, one message each way per round.

The engine starts it (``saguaro.workers``: a fresh interpreter, the draft handed over by name
or in shared memory, every start-up wait watched), talks to it through a ``Channel`` and
stops it. A worker that dies during start-up is a ``WorkerStartError`` that says how and what to
do; one that dies or goes silent later is detected by the engine (``WorkerLink.exchange``
raises), which then finishes the requests itself.

What the speculator needs, how it starts and how it serves are ``host.py``'s; this file is the process
transport alone.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

from saguaro.cores import pin_process
from saguaro.drafts import SpeculatorDraft, as_draft, received_draft
from saguaro.loading import LoadedModel
from saguaro.ssd.channel import Channel, ChannelClosed, MessageCounters
from saguaro.ssd.host import SpeculatorOptions, serve, start_speculator
from saguaro.ssd.outbox import Outbox
from saguaro.workers.process import WorkerProcess, free_port, parent_alive
from saguaro.workers.shipment import Shipment
from saguaro.ssd.protocol import CMD_STOP, RoundRequest, RoundResponse, pack_request, pack_response, \
    unpack_request, unpack_response

log = logging.getLogger("saguaro.ssd")
T = TypeVar("T")


HINT = "fix the error above, or run mode='sd', which needs no second process"
KILLED_HINT = ("if nothing killed it on purpose, the machine is probably out of memory: use a smaller or int4 "
               "draft (draft_weights='int4'), a smaller kv_cache_tokens, or mode='sd'")


def worker_main(port: int, counters: MessageCounters, draft: Shipment, opts: SpeculatorOptions) -> None:
    """Entry point of the speculator process (started by ``WorkerLink`` through ``saguaro.workers``)."""
    if opts.device == "cpu":
        pin_process(opts.cores, opts.threads)
    else:
        torch.cuda.set_device(torch.device(opts.device))
    backend = "gloo" if opts.device == "cpu" else "nccl"
    channel = Channel(1, port, counters, backend, opts.device, opts.timeout_s)
    speculator = start_speculator(received_draft(draft, opts.device, opts.dtype), opts)
    channel.send(torch.tensor([speculator.runner.config.vocab_size], dtype=torch.int64))  # ready

    def receive() -> RoundRequest | None:
        try:
            return unpack_request(channel.recv(alive=parent_alive))
        except ChannelClosed:  # the engine is gone: nobody to answer
            return None

    serve(speculator, receive, lambda response: channel.send(pack_response(response, opts.k)), channel.poll)


class WorkerLink:
    """The engine's handle on a running speculator process.

    ``draft`` is a draft kind (``saguaro.drafts``: its ``shipment`` says what the worker receives), or a bare
    registry name or path (the worker loads it) or ``LoadedModel`` (its weights reach the worker in shared
    memory). ``device`` is the target's: this end of an NCCL link receives the distributions there. Start-up
    raises ``WorkerStartError`` within ``opts.timeout_s`` of the worker dying or stalling (model loading gets at
    least 600 s).

    ``wait=False`` returns once the process is started, its channel connecting on a thread: the engine loads its
    target meanwhile (``saguaro.build.start_speculator_early``) and then calls ``wait_ready``.
    """

    def __init__(self, draft: SpeculatorDraft | LoadedModel | str, opts: SpeculatorOptions, device: str = "cpu",
                 wait: bool = True):
        self.opts = opts
        self.channel: Channel | None = None
        self.outbox: Outbox | None = None  # posts sent on a thread (a Gloo-only link: see ``outbox.py``)
        port = free_port()
        counters = MessageCounters()
        shipment = as_draft(draft).shipment()
        try:
            self.process = WorkerProcess(worker_main, (port, counters, shipment, opts), [counters.file, shipment.file],
                                         role="SSD speculator", hint=HINT, killed_hint=KILLED_HINT)
        finally:
            shipment.close()  # the worker inherited its own descriptor (or never started)
        # a speculator on the CPU: Gloo, whatever the target's device (its features cross as host frames)
        backend, device = ("gloo", "cpu") if opts.device == "cpu" else ("nccl", device)
        self._connected = _in_thread(lambda: Channel(0, port, counters, backend, device, opts.timeout_s))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the worker has connected and loaded its draft; on a failure kill it and raise."""
        try:
            self.channel = self.process.expect("connecting", self._connected.result, self.opts.timeout_s)
            # an NCCL link's device frames are queued on the caller's stream: its sends stay on the caller's thread
            self.outbox = Outbox(self.channel.send) if self.channel.gpu is None else None
            load_s = max(self.opts.timeout_s, 600)
            ready = self.process.expect("loading the draft", lambda: self._ready(load_s), load_s)
        except BaseException:
            self.kill()
            raise
        self.vocab = int(ready[0])

    def _ready(self, timeout_s: float) -> list[torch.Tensor]:
        try:
            return self.channel.recv(timeout_s=timeout_s, alive=self.process.is_alive)
        except ChannelClosed:
            # a worker that fails closes its socket as it exits, which ends the receive before the process can be
            # seen gone: wait for that, so that the start-up error says how it ended
            self.process.join(timeout=5)
            raise

    def post(self, request: RoundRequest) -> None:
        """Send a request that gets no response (``SpeculatorLink.post``), without waiting for the speculator to
        take it where the link allows (``outbox.py``). Raises ``ChannelClosed``."""
        self._send(request)

    def exchange(self, request: RoundRequest) -> RoundResponse:
        """Send one request, wait for the one response. Raises ``ChannelClosed`` on failure."""
        self._send(request, flush=True)
        reply = self.channel.recv(timeout_s=self.opts.timeout_s, alive=self.process.is_alive)
        return unpack_response(reply, self.opts.k, self.vocab)

    def _send(self, request: RoundRequest, flush: bool = False) -> None:
        """Through the outbox (``flush``: then wait until the speculator holds it and all before it), or a
        blocking send where there is none."""
        if self.outbox is None:
            self.channel.send(pack_request(request))
            return
        self.outbox.put(pack_request(request))
        if flush:
            self.outbox.flush()

    def stop(self) -> None:
        if self.process.is_alive() and self.channel is not None:
            try:
                self._send(RoundRequest(command=CMD_STOP), flush=True)
                self.process.join(timeout=5)
            except ChannelClosed:
                pass
        self.kill()

    def kill(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
        self.process.kill()
        if self.channel is not None:
            self.channel.close()


def _in_thread(work: Callable[[], T]) -> Future[T]:
    """``work()`` on a daemon thread (one a stalled worker leaves blocked must not hold up the exit)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 -- the caller's ``result()`` raises it
            future.set_exception(e)

    threading.Thread(target=run, name="saguaro-ssd-connect", daemon=True).start()
    return future
