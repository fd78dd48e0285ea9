"""``POST /infill`` in llama.cpp's server's shape, which editor plug-ins (llama.vim, llama.vscode) speak.

Request: ``input_prefix``, ``input_suffix``, ``input_extra`` (``[{"filename", "text"}]``, other files as
context), ``prompt`` (text the middle starts with), ``n_predict`` (-1: up to the context's end),
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stream``; unknown fields are ignored, as
llama.cpp does. Defaults are llama.cpp's (temperature 0.8, top_k 40, top_p 0.95). The answer is
``{"content", "stop": true, "stop_type": "eos" | "word" | "limit", "tokens_predicted",
"tokens_evaluated", "model"}``; streamed, one ``data: {"content", "stop": false}`` event per piece, then
the full object with ``"stop": true``. Prompt layout: ``saguaro.server.fim``.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from saguaro.engine.outputs import RequestOutput
from saguaro.sampling.params import INT64_MAX, INT64_MIN, SamplingParams
from saguaro.server.async_engine import ServerClosing
from saguaro.server.fim import FimTokens, NoFillInTheMiddle, fim_prompt
from saguaro.server.openai_routes import Served
from saguaro.server.responses import Choices, Stream, error


class ExtraFile(BaseModel):
    filename: str = ""
    text: str


class InfillRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int = Field(default=-1, ge=-1)
    temperature: float = Field(default=0.8, ge=0, le=2)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0, le=1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False


def _stop_type(out: RequestOutput, ends: set[int]) -> str:
    if out.finish_reason == "stop":
        return "eos" if out.token_ids and out.token_ids[-1] in ends else "word"
    return "limit"


def _final(out: RequestOutput, served: Served, ends: set[int], content: str) -> dict:
    return {"content": content, "stop": True, "stop_type": _stop_type(out, ends), "model": served.model_name,
            "tokens_predicted": len(out.token_ids), "tokens_evaluated": len(out.prompt_token_ids)}


async def _answer(choices: Choices, served: Served, ends: set[int]):
    async for _, c in choices.chunks():
        if c.finish_reason and c.finish_reason.startswith(("error", "abort")):
            return error(f"generation failed ({c.finish_reason})", 500, "server_error")
        if c.finished:
            return _final(c.output, served, ends, c.output.text)


async def _events(choices: Choices, served: Served, ends: set[int]) -> AsyncIterator[str]:
    async for _, c in choices.chunks():
        if c.finish_reason and c.finish_reason.startswith(("error", "abort")):
            yield f"data: {json.dumps({'error': {'message': c.finish_reason, 'type': 'server_error'}})}\n\n"
            return
        if c.finished:
            yield f"data: {json.dumps(_final(c.output, served, ends, c.text), ensure_ascii=False)}\n\n"
        elif c.text:
            yield f"data: {json.dumps({'content': c.text, 'stop': False}, ensure_ascii=False)}\n\n"


def add_infill_route(app: FastAPI, served: Served) -> None:
    @app.post("/infill")
    async def infill(req: InfillRequest):
        tok = served.llm.tokenizer
        try:
            fim = FimTokens.of(tok)
            extra = [(f.filename, f.text) for f in req.input_extra]
            encoder = served.engine.prompts  # off the event loop, an over-long text refused before tokenizing
            encoder.check_length(req.input_prefix + req.input_suffix + req.prompt + "".join(t for _, t in extra))
            ids = await encoder.off_loop(fim_prompt, tok, req.input_prefix, req.input_suffix, extra, req.prompt)
            room = served.longest - len(ids)
            if room < 1 or req.n_predict > room:
                raise ValueError(f"the prompt has {len(ids)} tokens and n_predict asks for {req.n_predict}, but the "
                                 f"context holds {served.longest}")
            params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                                    stop=req.stop, max_tokens=room if req.n_predict < 1 else req.n_predict,
                                    stop_token_ids=list(fim.stops))
            choices = Choices(served.engine)
            choices.submit(0, ids, params, None)
        except NoFillInTheMiddle as e:
            return error(str(e))
        except ServerClosing as e:
            return error(str(e), 503, "server_error")
        except ValueError as e:
            return error(str(e))
        ends = set(tok.eos_token_ids) | set(fim.stops)
        if req.stream:
            return Stream(_events(choices, served, ends), choices.abort)
        return await _answer(choices, served, ends)
