"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions, /metrics, /health.

Requests from all clients share one continuously batched engine (``AsyncEngine``). Streaming
uses server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk with no choices carries the usage. Responses also
carry a ``saguaro`` block with timings and speculation metrics (one per choice when there are
several). Request fields: ``saguaro.server.schemas``; metrics: ``saguaro.server.metrics``.

A client that disconnects aborts its requests: their KV blocks are free by the next round (the
next prefill chunk or decode round). Limits and deadlines: ``saguaro.server.lifecycle``.
Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a
request the engine cannot serve or a limit it breaks, 401 without the API key (``api_key``), 404
for another model name, 408 for a body not sent in time, 413 for a body over ``max_request_bytes``
(``saguaro.server.request_limits``), 503 while shutting down, 500 if the
engine fails on a request; a bad request never touches the others. ``/health`` is 503 while the
engine loop is stalled.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from saguaro.engine.outputs import RequestOutput, StreamChunk
from saguaro.sampling.params import SamplingParams
from saguaro.server.async_engine import AsyncEngine, ServerClosing
from saguaro.server.end_of_turn import end_of_turn_ids
from saguaro.server.lifecycle import BodyDeadline, GracefulServer, ServerLimits
from saguaro.server.request_limits import BodyLimit, default_max_request_bytes
from saguaro.server.schemas import ChatRequest, CompletionRequest, UnsupportedField, BaseRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def _error(message: str, status: int = 400, kind: str = "invalid_request_error", code: str | None = None
           ) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


class _Choices:
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


class _Stream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends: done, client gone, or failed."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _APIKey:
    """ASGI middleware: /v1/* needs ``Authorization: Bearer <key>`` (pure ASGI, so streaming is untouched)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error("missing or wrong API key: send 'Authorization: Bearer <key>' (the key the "
                                  "server was started with, --api-key)", 401, "authentication_error", "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _usage(prompts: list[list[int]], outputs: list[RequestOutput]) -> dict[str, int]:
    n_prompt, n_out = sum(len(p) for p in prompts), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _extras(out: RequestOutput) -> dict[str, Any]:
    return {"timings": asdict(out.timings), "speculation": None if out.spec is None else asdict(out.spec)}


_UNION_TAGS = {"str", "int", "float", "bool"}  # pydantic names a union's member in the error location
_UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
                 "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def _validation_message(exc: RequestValidationError) -> str:
    """One readable line: each bad field once (a union's per-member errors become "must be A or B")."""
    parts: dict[str, str] = {}
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
        path, union = [], False
        for x in e["loc"]:
            if isinstance(x, str) and (x in _UNION_TAGS or "[" in x):
                union = True
                break
            if x != "body":
                path.append(str(x))
        where = ".".join(path)
        if union:
            expected = _UNION_FIELDS.get(path[-1] if path else "", "of another type")
            parts[where] = f"{where}: must be {expected}"
        else:
            parts.setdefault(where, f"{where}: {e['msg']}" if where else e["msg"])
    return "invalid request: " + "; ".join(parts.values())


def _context_error(longest: int, n_prompt: int, n_out: int) -> str:
    """vLLM's wording, so clients that parse it keep working."""
    return (f"This model's maximum context length is {longest} tokens. However, you requested {n_prompt + n_out} "
            f"tokens ({n_prompt} in the messages, {n_out} in the completion). Please reduce the length of the "
            "messages or completion.")


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
               limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The server's routes. Long because they are closures over one engine and its limits, declared together."""
    app = FastAPI(title="Saguaro", description="OpenAI-compatible server for lossless SSD decoding")
    if api_key:
        app.add_middleware(_APIKey, key=api_key)
    app.add_middleware(BodyDeadline, timeout_s=limits.body_timeout_s, on_timeout=lambda: _error(
        f"the request body did not arrive within {limits.body_timeout_s:g} s", 408, code="request_timeout"))
    llm = engine.llm
    max_bytes = limits.max_request_bytes or default_max_request_bytes(llm.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=max_bytes, on_too_large=lambda: _error(  # outermost: before the body
        f"the request body is over {max_bytes} bytes (the server's --max-request-bytes)", 413,
        code="request_too_large"))
    capacity = llm.engine.target.blocks.num_blocks * llm.engine.target.block_size - llm.engine.decoder.lookahead
    longest = min(llm.max_model_len, capacity)  # the most a request's prompt plus output may hold
    end_of_turn = end_of_turn_ids(llm.tokenizer)  # chat requests stop there

    def sampling(req: BaseRequest, kind: str, n_prompt: int) -> list[SamplingParams]:
        """Each choice's settings; raises ``ValueError`` when prompt plus completion overflow the context."""
        asked = req.requested_max_tokens()
        if asked is None:  # OpenAI's default for completions, the rest of the context for chat
            default = COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else longest
            asked = max(1, min(default, longest - n_prompt))
        if n_prompt + asked > longest:
            raise ValueError(_context_error(longest, n_prompt, asked))
        stop_ids = end_of_turn if kind == "chat" else []
        return [req.sampling(c, asked, stop_ids) for c in range(req.n)]

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_validation_message(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(str(exc.detail), exc.status_code, kind)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:  # a bug: still JSON, never plain text
        return _error(f"internal error: {type(exc).__name__}", 500, "server_error")

    async def run(request: Request, req: BaseRequest, prompts: list[tuple[list[int], str | None]], kind: str):
        if req.model is not None and req.model != model_name:
            return _error(f"model {req.model!r} is not served here; this server serves {model_name!r} "
                          "(GET /v1/models)", 404, code="model_not_found")
        try:
            req.check_supported()
        except UnsupportedField as e:
            return _error(str(e))
        if len(prompts) * req.n > limits.max_choices:
            return _error(f"{len(prompts)} prompts x n = {req.n} asks for {len(prompts) * req.n} completions; this "
                          f"server allows at most {limits.max_choices} per request")
        choices = _Choices(engine)
        p = 0
        try:
            for p, (ids, text) in enumerate(prompts):
                for c, params in enumerate(sampling(req, kind, len(ids))):
                    choices.submit(p * req.n + c, ids, params, text)
        except ServerClosing as e:
            choices.abort()
            return _error(str(e), 503, "server_error")
        except ValueError as e:  # refused (too long, token ids outside the vocabulary, ...)
            choices.abort()
            where = f"prompt {p}: " if len(prompts) > 1 else ""
            return _error(where + str(e))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        meta = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}
        prompt_ids = [ids for ids, _ in prompts]
        if req.stream:
            return _Stream(_events(choices, req, kind, meta, prompt_ids), choices.abort)
        return await _collect(request, choices, kind, meta, prompt_ids)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "saguaro",
                                            "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            prompts = req.prompts()
        except ValueError as e:
            return _error(str(e))
        try:  # tokenized off the event loop; a prompt too long for the context is refused before that
            encoded = [(await engine.prompts.encode(p), p) if isinstance(p, str) else (list(p), None)
                       for p in prompts]
        except ValueError as e:
            return _error(str(e))
        return await run(request, req, encoded, "completion")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            text = await engine.prompts.render_chat([m.as_template_input() for m in req.messages])
        except Exception as e:
            return _error(f"chat template failed: {e}")
        try:
            ids = await engine.prompts.encode(text, add_special_tokens=False)
        except ValueError as e:
            return _error(str(e))
        return await run(request, req, [(ids, None)], "chat")

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        if engine.stalled(limits.health_stall_s):
            return JSONResponse({"status": "stalled", "detail": f"the engine has completed no step for over "
                                 f"{limits.health_stall_s:g} s while requests wait"}, status_code=503)
        return {"status": "ok"}

    return app


def _choice(kind: str, index: int, text: str, finish: str | None, stream: bool, first: bool = False) -> dict:
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if stream:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": None, "finish_reason": finish}


async def _events(choices: _Choices, req: BaseRequest, kind: str, meta: dict, prompts: list[list[int]]
                  ) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    started: set[int] = set()
    finals: list[RequestOutput] = []

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async for index, c in choices.chunks():
        if c.finish_reason and c.finish_reason.startswith("error"):
            yield event({"error": {"message": c.finish_reason, "type": "server_error", "param": None, "code": None}})
            break
        if not c.text and not c.finished and index in started:
            continue  # tokens that complete no character yet
        payload = {**meta, "object": obj, "choices": [_choice(kind, index, c.text, c.finish_reason if c.finished
                                                               else None, True, index not in started)]}
        started.add(index)
        if req.include_usage:
            payload["usage"] = None
        if c.output is not None:
            finals.append(c.output)
            payload["saguaro"] = _extras(c.output)
        yield event(payload)
    else:
        if req.include_usage:
            yield event({**meta, "object": obj, "choices": [], "usage": _usage(prompts, finals)})
    yield "data: [DONE]\n\n"


async def _collect(request: Request, choices: _Choices, kind: str, meta: dict, prompts: list[list[int]]):
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
                return _error(f"generation failed ({c.finish_reason})", 500, "server_error")
            if c.finish_reason == "abort" and c.output is None:  # aborted before it started
                return _error("the request was aborted (the client went away or the server is shutting down)",
                              503, "server_error")
            if c.finished:  # an aborted one (the shutdown deadline) ends with what it has, finish reason "abort"
                outputs[index] = c.output
    finally:
        watcher.cancel()
        choices.abort()
    ordered = [outputs[i] for i in sorted(outputs)]
    extras = [_extras(o) for o in ordered]
    return {**meta, "object": "chat.completion" if kind == "chat" else "text_completion",
            "choices": [_choice(kind, i, o.text, o.finish_reason, False) for i, o in enumerate(ordered)],
            "usage": _usage(prompts, ordered), "saguaro": extras[0] if len(extras) == 1 else extras}


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          limits: ServerLimits = ServerLimits()) -> None:
    """Serve until SIGTERM/SIGINT; then the shutdown deadline (``saguaro.server.lifecycle``) applies, and the
    engine, with its SSD speculator, is closed."""
    import uvicorn
    engine = AsyncEngine(llm)
    try:
        config = uvicorn.Config(create_app(engine, model_name, api_key, limits), host=host, port=port,
                                log_level="info")
        GracefulServer(config, limits.shutdown_timeout_s, engine.abort_all, engine.close).run()
    finally:
        engine.close()  # (a no-op once the server closed it) when uvicorn fails to start
