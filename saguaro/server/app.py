"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions.

Requests from all clients share one continuously batched engine (``AsyncEngine``).
Streaming uses server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``.
Responses carry the usual ``usage`` block plus a ``saguaro`` block with timings and
speculation metrics.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from saguaro.engine.outputs import RequestOutput, StreamChunk
from saguaro.sampling.params import SamplingParams
from saguaro.server.async_engine import AsyncEngine


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = 1

    def params(self) -> SamplingParams:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, stop=stop, seed=self.seed)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def _extras(out: RequestOutput) -> dict[str, Any]:
    return {"timings": asdict(out.timings), "speculation": None if out.spec is None else asdict(out.spec)}


def _usage(out: RequestOutput) -> dict[str, int]:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def create_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="Saguaro", description="OpenAI-compatible server for lossless SSD decoding")

    async def chunks(q) -> AsyncIterator[StreamChunk]:
        while True:
            chunk = await asyncio.to_thread(q.get)
            yield chunk
            if chunk.finished:
                return

    async def run(prompt, req: _Sampling, kind: str):
        try:
            q = engine.submit(prompt, req.params())
        except ValueError as e:
            return _error(str(e))
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict[str, Any]:
            if kind == "chat":
                body = {"delta": {"content": text}} if delta else {"message": {"role": "assistant", "content": text}}
            else:
                body = {"text": text, "logprobs": None}
            return {"index": 0, **body, "finish_reason": finish}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                async for c in chunks(q):
                    if c.finish_reason and c.finish_reason.startswith("error"):
                        yield f"data: {json.dumps({'error': {'message': c.finish_reason}})}\n\n"
                        break
                    payload = {"id": rid, "object": obj + (".chunk" if kind == "chat" else ""), "created": created,
                               "model": model_name, "choices": [choice(c.text, c.finish_reason, True)]}
                    if c.output is not None:
                        payload["usage"] = _usage(c.output)
                        payload["saguaro"] = _extras(c.output)
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        final = None
        async for c in chunks(q):
            if c.finish_reason and c.finish_reason.startswith("error"):
                return _error(c.finish_reason, 500)
            final = c.output
        return {"id": rid, "object": obj, "created": created, "model": model_name,
                "choices": [choice(final.text, final.finish_reason, False)],
                "usage": _usage(final), "saguaro": _extras(final)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "saguaro"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await run(req.prompt, req, "completion")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        tok = engine.llm.tokenizer
        try:
            text = tok.apply_chat_template([m.model_dump() for m in req.messages], add_generation_prompt=True)
        except Exception as e:
            return _error(f"chat template failed: {e}")
        return await run(tok.encode(text, add_special_tokens=False), req, "chat")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn
    engine = AsyncEngine(llm)
    try:
        uvicorn.run(create_app(engine, model_name), host=host, port=port, log_level="info")
    finally:
        engine.close()
