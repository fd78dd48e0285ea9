"""Run the engine loop on a background thread so many HTTP requests share one batch.

Only the loop thread touches the engine. A caller submits (prompt ids, params, ``deliver``) and
gets a request id; the loop calls ``deliver(chunk)`` on its own thread for every chunk, the last
one with ``finished=True``. ``abort(id)`` (a client that went away) finishes the request at the
next turn of the loop (the next prefill chunk or decode round) and frees its KV blocks then, not
when it would have ended; ``abort_all`` does so for every request (the shutdown deadline). A
failing request gets an error chunk and the loop goes on with the rest. ``stalled`` says whether
the loop has gone without completing a step for too long while work waits (``/health``).

Each chunk's text comes from a ``StreamText`` (only the new tokens are decoded, and what a stop
string may still cut is held back), made and delivered on a text thread of its own, in order, so
that detokenizing never delays the engine's next step; the metrics (``ServerMetrics``) are counted
on the loop thread, after every round. Prompts are tokenized on a pool of their own
(``PromptEncoder``, ``prompts``): neither the event loop nor the engine waits for a long one.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from saguaro.engine.detokenizer import StreamText
from saguaro.engine.outputs import StreamChunk
from saguaro.engine.sequence import Sequence
from saguaro.llm import LLM
from saguaro.sampling.params import SamplingParams
from saguaro.server.metrics import RequestCounts, ServerMetrics
from saguaro.server.prompt_encoder import PromptEncoder

log = logging.getLogger("saguaro.server")

Deliver = Callable[[StreamChunk], None]


class ServerClosing(RuntimeError):
    """A request submitted after the shutdown deadline."""


@dataclass
class _Submission:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    deliver: Deliver
    counts: RequestCounts = field(default_factory=RequestCounts)  # its clock starts at submission


@dataclass
class _Live:
    sub: _Submission
    seq: Sequence
    text: StreamText  # used on the text thread only
    closed: bool = False  # its last chunk was delivered (text thread)
    sent: bool = False  # whether a chunk went out (the first carries the prompt's logprobs)


class AsyncEngine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._inbox: queue.Queue[_Submission] = queue.Queue()
        self._aborts: queue.Queue[tuple[int, str]] = queue.Queue()  # (id, reason) of requests to finish early
        self._queued: set[int] = set()  # ids submitted but not yet taken from the inbox
        self._cancelled: set[int] = set()  # of those, the ones aborted before the loop took them
        self._live: dict[int, _Live] = {}  # by request id
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = False
        self._abort_all = threading.Event()
        self.beat = time.monotonic()  # when the loop last completed a step or found nothing to do
        self.metrics = ServerMetrics(llm.engine, queued=self._inbox.qsize)
        self.prompts = PromptEncoder(llm.tokenizer, llm.max_model_len)
        self._text = ThreadPoolExecutor(1, thread_name_prefix="saguaro-text")  # one thread: chunks stay in order
        self._thread = threading.Thread(target=self._loop, name="saguaro-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, deliver: Deliver,
               prompt: str | None = None) -> int:
        """Queue a request; return its id. Bad requests (too long, bad token ids) raise here, before anything is
        queued."""
        if self.closing:
            raise ServerClosing("the server is shutting down")
        self.llm.engine.check_request(prompt_ids, params)
        request_id = next(self._ids)
        self._queued.add(request_id)
        self._inbox.put(_Submission(request_id, list(prompt_ids), params, prompt, deliver))
        self._wake.set()
        return request_id

    def abort(self, request_id: int) -> None:
        """Finish a request early (its client is gone); a no-op for one that already finished."""
        self._aborts.put((request_id, "abort"))
        self._wake.set()

    @property
    def closing(self) -> bool:
        """After ``abort_all``: new requests are refused."""
        return self._abort_all.is_set()

    def abort_all(self) -> None:
        """Finish every request now, queued or running, with finish reason "abort" (the shutdown deadline)."""
        self._abort_all.set()
        self._wake.set()

    def stalled(self, bound_s: float) -> bool:
        """Whether the loop has completed no step for ``bound_s`` seconds while work waits (or has died)."""
        if not self._thread.is_alive():
            return True
        return time.monotonic() - self.beat > bound_s

    # -- the loop thread -----------------------------------------------------------
    def _loop(self) -> None:
        engine = self.llm.engine
        while not self._stop:
            self._drain_inbox()
            self.beat = time.monotonic()
            if not engine.has_unfinished:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                events = engine.step()
            except Exception as e:
                log.exception("engine step failed; failing the requests in flight")
                for live in list(self._live.values()):
                    self._end(live, f"error: {type(e).__name__}: {e}")
                continue
            by_seq = {live.seq.seq_id: live for live in self._live.values()}
            for seq, tokens in events:
                live = by_seq.get(seq.seq_id)
                if live is not None and (tokens or seq.finished):
                    try:
                        self._send(live, tokens)
                    except Exception as e:  # this request's metrics failed: it alone ends
                        log.exception("request %d failed after its step", live.sub.request_id)
                        self._end(live, f"error: {type(e).__name__}: {e}")

    def _drain_inbox(self) -> None:
        engine = self.llm.engine
        while not self._inbox.empty():
            sub = self._inbox.get()
            self._queued.discard(sub.request_id)
            if sub.request_id in self._cancelled:
                self._cancelled.discard(sub.request_id)
                _safely(sub.deliver, StreamChunk(-1, [], "", True, "abort"))
                continue
            try:
                seq = engine.add_request(sub.prompt_ids, sub.params, sub.prompt)
            except Exception as e:  # refused: tell this caller only
                _safely(sub.deliver, StreamChunk(-1, [], "", True, f"error: {e}"))
                continue
            text = StreamText(self.llm.tokenizer, sub.params.stop, sub.params.skip_special_tokens)
            self._live[sub.request_id] = _Live(sub, seq, text)
        if self._abort_all.is_set():
            for request_id in list(self._live) + list(self._queued):
                self._aborts.put((request_id, "abort"))
        while not self._aborts.empty():
            request_id, reason = self._aborts.get()
            live = self._live.get(request_id)
            if live is not None:
                self._end(live, reason)
            elif request_id in self._queued:  # submitted after the inbox was drained: drop it when it comes
                self._cancelled.add(request_id)

    def _send(self, live: _Live, tokens: list[int]) -> None:
        seq = live.seq
        if seq.finished:
            del self._live[live.sub.request_id]
            self.metrics.on_finish(seq, live.sub.counts)
        else:
            self.metrics.on_tokens(seq, live.sub.counts)
        params = seq.params  # logprobs taken here, on the loop thread, while the sequence holds still
        logprobs = seq.output_logprobs[len(seq.output_logprobs) - len(tokens):] if params.logprobs is not None else None
        prompt_logprobs = seq.prompt_logprobs if params.prompt_logprobs is not None and not live.sent else None
        live.sent = True
        self._text.submit(self._deliver, live, list(tokens), seq.finished, seq.finish_reason, logprobs, prompt_logprobs)

    def _end(self, live: _Live, reason: str) -> None:
        """Finish a live request now (abort or error): free its blocks and send its last chunk."""
        self.llm.engine.abort(live.seq, reason)
        if live.seq.finish_reason != reason:  # it had finished already (its last chunk failed): say why now
            live.seq.finish_reason = reason
        self._live.pop(live.sub.request_id, None)
        self.metrics.on_finish(live.seq, live.sub.counts)
        self._text.submit(self._deliver, live, [], True, reason)

    # -- the text thread -----------------------------------------------------------
    def _deliver(self, live: _Live, tokens: list[int], finished: bool, reason: str | None,
                 logprobs: list | None = None, prompt_logprobs: list | None = None) -> None:
        """Make a chunk's text and hand the chunk over; a finished request's text is its final (stop-cut) one."""
        if live.closed:
            return
        try:
            final = self.llm.engine.output(live.seq) if finished else None
            text = live.text.delta(tokens, final.text if final else None)
        except Exception as e:  # this request's text failed: it alone ends
            log.exception("request %d failed making its text", live.sub.request_id)
            live.closed = True
            _safely(live.sub.deliver, StreamChunk(live.seq.seq_id, [], "", True, f"error: {type(e).__name__}: {e}"))
            self.abort(live.sub.request_id)  # its blocks are freed on the loop thread
            return
        live.closed = finished
        chunk = StreamChunk(live.seq.seq_id, tokens, text, finished, reason, final, logprobs, prompt_logprobs)
        if not _safely(live.sub.deliver, chunk) and not finished:
            self.abort(live.sub.request_id)  # nobody is listening any more

    def close(self) -> None:
        """Stop the loop and close the engine (its SSD speculator included); once."""
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._text.shutdown(wait=True)  # the last chunks go out
        self.prompts.close()
        self.llm.close()


def _safely(deliver: Deliver, chunk: StreamChunk) -> bool:
    try:
        deliver(chunk)
        return True
    except Exception:  # the caller's event loop is closed: it no longer wants chunks
        return False
