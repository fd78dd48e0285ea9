"""The bodies the server sends back: whole responses, server-sent event streams, and OpenAI-shaped errors.

One HTTP request is one or more engine requests (``Choices``: one per prompt and choice), whose chunks
share a queue. A whole response waits for all of them; a stream forwards each chunk as OpenAI's chunk
format, ending with ``data: [DONE]`` (and, with ``stream_options.include_usage``, a last chunk with no
choices that carries the usage). Logprobs take the shapes in ``saguaro.server.logprob_format``.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from saguaro.engine.outputs import RequestOutput, StreamChunk
from saguaro.loading.tokenizer import Tokenizer
from saguaro.sampling.params import SamplingParams
from saguaro.server.async_engine import AsyncEngine
from saguaro.server.logprob_format import chat_logprobs, completion_logprobs
from saguaro.server.tools import parse_tool_calls


def error(message: str, status: int = 400, kind: str = "invalid_request_error", code: str | None = None
          ) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


class Choices:
    """The engine requests behind one HTTP request, one per (prompt, choice); their chunks share one queue."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, StreamChunk]] = asyncio.Queue()
        self.ids: list[int] = []

    def submit(self, index: int, prompt_ids: list[int], params: SamplingParams, text: str | None) -> None:
        def deliver(chunk: StreamChunk) -> None:  # on the engine thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, chunk))
        self.ids.append(self.engine.submit(prompt_ids, params, deliver, text))

    def abort(self) -> None:
        for request_id in self.ids:
            self.engine.abort(request_id)  # a no-op for the finished ones

    async def chunks(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        left = len(self.ids)
        while left:
            index, chunk = await self.queue.get()
            yield index, chunk
            left -= chunk.finished


class Stream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends: done, client gone, or failed."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@dataclass
class Reply:
    """What shapes one HTTP request's answer."""
    kind: str  # "completion" or "chat"
    meta: dict[str, Any]  # id, created, model
    prompts: list[list[int]]  # each choice's prompt ids, by prompt
    tokenizer: Tokenizer
    logprobs: bool = False  # report them
    echo: list[str] | None = None  # completions with echo: each prompt's text, put before its choices' text
    include_usage: bool = False
    n: int = 1  # choices per prompt
    tools: str | None = None  # chat with tools: "auto" (parse <tool_call> blocks) or "forced" (the text is a call)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def choice(self, index: int, text: str, finish: str | None, stream: bool, first: bool = False,
               logprobs: list | None = None, prompt_logprobs: list | None = None) -> dict:
        lp = None
        if self.logprobs and self.kind == "chat":
            lp = chat_logprobs(self.tokenizer, logprobs or [])
        if self.echo is not None and (first or not stream):
            text = self.echo[index // self.n] + text
        if self.logprobs and self.kind == "completion":
            prompt = prompt_logprobs if self.echo is not None and (first or not stream) else None
            lp = completion_logprobs(self.tokenizer, logprobs or [], self.prompts[index // self.n][0], prompt)
        if self.kind == "completion":
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None and (finish is not None or not stream):  # a stream holds a tools choice's text
            content, calls = parse_tool_calls(text, self.tools == "forced")
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [c.as_dict(i if stream else None) for i, c in enumerate(calls)]}
                finish = "tool_calls" if finish == "stop" or self.tools == "forced" else finish
        if stream:
            delta = message if first else {k: v for k, v in message.items() if k != "role"}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}

    def usage(self, outputs: list[RequestOutput]) -> dict[str, int]:
        n_prompt, n_out = sum(len(p) for p in self.prompts), sum(len(o.token_ids) for o in outputs)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def extras(out: RequestOutput) -> dict[str, Any]:
    return {"timings": asdict(out.timings), "speculation": None if out.spec is None else asdict(out.spec)}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def events(choices: Choices, reply: Reply) -> AsyncIterator[str]:
    """The stream of one HTTP request's chunks (see the module docstring)."""
    obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
    started: set[int] = set()
    finals: list[RequestOutput] = []
    held: dict[int, tuple[str, list]] = {}  # with tools, a choice's text and logprobs until it ends (then parsed)
    async for index, c in choices.chunks():
        if c.finish_reason and c.finish_reason.startswith("error"):
            yield _event({"error": {"message": c.finish_reason, "type": "server_error", "param": None, "code": None}})
            break
        text, logprobs = c.text, c.logprobs
        if reply.tools is not None:
            before, lps = held.get(index, ("", []))
            text, logprobs = before + c.text, lps + list(c.logprobs or [])
            if not c.finished:
                held[index] = (text, logprobs)
                continue
        if not text and not c.finished and index in started and not logprobs:
            continue  # tokens that complete no character yet
        choice = reply.choice(index, text, c.finish_reason if c.finished else None, True, index not in started,
                              logprobs, c.prompt_logprobs)
        payload = {**reply.meta, "object": obj, "choices": [choice]}
        started.add(index)
        if reply.include_usage:
            payload["usage"] = None
        if c.output is not None:
            finals.append(c.output)
            payload["saguaro"] = extras(c.output)
        yield _event(payload)
    else:
        if reply.include_usage:
            yield _event({**reply.meta, "object": obj, "choices": [], "usage": reply.usage(finals)})
    yield "data: [DONE]\n\n"


async def collect(request: Request, choices: Choices, reply: Reply):
    """The whole response, once every choice finished; an error response if one failed."""
    async def watch() -> None:  # a client that hangs up aborts its requests
        while (await request.receive())["type"] != "http.disconnect":
            pass
        choices.abort()

    watcher = asyncio.create_task(watch())
    outputs: dict[int, RequestOutput] = {}
    try:
        async for index, c in choices.chunks():
            if c.finish_reason and c.finish_reason.startswith("error"):
                choices.abort()
                return error(f"generation failed ({c.finish_reason})", 500, "server_error")
            if c.finish_reason == "abort" and c.output is None:  # aborted before it started
                return error("the request was aborted (the client went away or the server is shutting down)",
                             503, "server_error")
            if c.finished:  # an aborted one (the shutdown deadline) ends with what it has, finish reason "abort"
                outputs[index] = c.output
    finally:
        watcher.cancel()
        choices.abort()
    ordered = [outputs[i] for i in sorted(outputs)]
    more = [extras(o) for o in ordered]
    return {**reply.meta, "object": reply.object,
            "choices": [reply.choice(i, o.text, o.finish_reason, False, logprobs=o.logprobs,
                                     prompt_logprobs=o.prompt_logprobs) for i, o in enumerate(ordered)],
            "usage": reply.usage(ordered), "saguaro": more[0] if len(more) == 1 else more}
