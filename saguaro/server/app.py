"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions, /metrics, /health,
llama.cpp's /infill for editors, and vLLM's /tokenize, /detokenize and /tokenizer_info for evaluation clients.

The OpenAI routes are ``saguaro.server.openai_routes``; the bodies they send, ``saguaro.server.responses``.

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

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from saguaro.server.async_engine import AsyncEngine
from saguaro.server.infill import add_infill_route
from saguaro.server.lifecycle import BodyDeadline, GracefulServer, ServerLimits
from saguaro.server.openai_routes import Served, add_openai_routes
from saguaro.server.responses import error
from saguaro.server.request_limits import BodyLimit, default_max_request_bytes
from saguaro.server.tokenize_routes import add_tokenize_routes


PROTECTED = ("/v1", "/infill", "/tokenize", "/detokenize", "/tokenizer_info")  # what --api-key guards


class _APIKey:
    """ASGI middleware: /v1/*, /infill and the tokenizer routes need ``Authorization: Bearer <key>`` (pure ASGI,
    so streaming is untouched)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error("missing or wrong API key: send 'Authorization: Bearer <key>' (the key the "
                                  "server was started with, --api-key)", 401, "authentication_error", "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
               limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The server: its middleware, error handlers and routes, over one engine."""
    app = FastAPI(title="Saguaro", description="OpenAI-compatible server for lossless SSD decoding")
    if api_key:
        app.add_middleware(_APIKey, key=api_key)
    app.add_middleware(BodyDeadline, timeout_s=limits.body_timeout_s, on_timeout=lambda: error(
        f"the request body did not arrive within {limits.body_timeout_s:g} s", 408, code="request_timeout"))
    max_bytes = limits.max_request_bytes or default_max_request_bytes(engine.llm.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=max_bytes, on_too_large=lambda: error(  # outermost: before the body
        f"the request body is over {max_bytes} bytes (the server's --max-request-bytes)", 413,
        code="request_too_large"))
    _add_error_handlers(app)
    served = Served.of(engine, model_name, limits)
    add_openai_routes(app, served)
    add_infill_route(app, served)
    add_tokenize_routes(app, served)
    _add_service_routes(app, engine, limits)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(_validation_message(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error(str(exc.detail), exc.status_code, kind)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:  # a bug: still JSON, never plain text
        return error(f"internal error: {type(exc).__name__}", 500, "server_error")


def _add_service_routes(app: FastAPI, engine: AsyncEngine, limits: ServerLimits) -> None:
    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        if engine.stalled(limits.health_stall_s):
            return JSONResponse({"status": "stalled", "detail": f"the engine has completed no step for over "
                                 f"{limits.health_stall_s:g} s while requests wait"}, status_code=503)
        return {"status": "ok"}


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
