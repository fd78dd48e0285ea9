"""Run the engine loop on a background thread so many HTTP requests share one batch.

Only the loop thread touches the engine. Callers submit (prompt, params) and get a queue of
``StreamChunk``s; a failing request gets an error chunk and the loop goes on with the rest.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from saguaro.engine.outputs import StreamChunk
from saguaro.engine.sequence import Sequence
from saguaro.llm import LLM
from saguaro.sampling.params import SamplingParams

log = logging.getLogger("saguaro.server")


@dataclass
class _Submission:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    out: queue.Queue


class AsyncEngine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._inbox: queue.Queue[_Submission] = queue.Queue()
        self._streams: dict[int, tuple[Sequence, queue.Queue, str]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="saguaro-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: str | list[int], params: SamplingParams) -> queue.Queue:
        """Queue a request; chunks (and finally one with ``finished=True``) arrive on the returned queue.

        Bad requests (too long, bad token ids) raise here, before anything is queued.
        """
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.llm.engine.check_request(ids, params)
        out: queue.Queue = queue.Queue()
        self._inbox.put(_Submission(ids, params, prompt if isinstance(prompt, str) else None, out))
        self._wake.set()
        return out

    def _loop(self) -> None:
        engine = self.llm.engine
        while not self._stop:
            while not self._inbox.empty():
                sub = self._inbox.get()
                try:
                    seq = engine.add_request(sub.prompt_ids, sub.params, sub.prompt)
                    self._streams[seq.seq_id] = (seq, sub.out, "")
                except Exception as e:  # refused: tell this caller only
                    sub.out.put(StreamChunk(-1, [], "", True, f"error: {e}"))
            if not engine.has_unfinished:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                events = engine.step()
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                for seq, out, _ in self._streams.values():
                    engine.abort(seq, "error")
                    out.put(StreamChunk(seq.seq_id, [], "", True, "error"))
                self._streams.clear()
                continue
            for seq, tokens in events:
                entry = self._streams.get(seq.seq_id)
                if entry is None or not tokens:
                    continue
                _, out, shown = entry
                output = engine.output(seq)
                delta = output.text[len(shown):]
                self._streams[seq.seq_id] = (seq, out, output.text)
                out.put(StreamChunk(seq.seq_id, tokens, delta, seq.finished, seq.finish_reason,
                                    output if seq.finished else None))
                if seq.finished:
                    del self._streams[seq.seq_id]

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.llm.close()
