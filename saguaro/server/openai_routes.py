"""The OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions over one engine.

A request becomes one engine request per prompt and choice (``n``); with a ``seed``, choice ``i``
uses ``seed + i``. Everything that can be refused is refused before anything runs: a bad field, a
prompt that overflows the context, too many choices; a request refused half-way aborts what it had
submitted, so no other request notices. Fields: ``saguaro.server.schemas``.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

from fastapi import FastAPI, Request

from saguaro.llm import LLM
from saguaro.sampling.params import SamplingParams
from saguaro.server.async_engine import AsyncEngine, ServerClosing
from saguaro.server.end_of_turn import end_of_turn_ids
from saguaro.server.fim import FimTokens, NoFillInTheMiddle, fim_prompt
from saguaro.server.lifecycle import ServerLimits
from saguaro.server.responses import Choices, Reply, Stream, collect, error, events
from saguaro.server.schemas import BaseRequest, ChatRequest, CompletionRequest, UnsupportedField

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


@dataclass
class Served:
    """One served model and what every route needs of it."""
    engine: AsyncEngine
    model_name: str
    limits: ServerLimits
    longest: int  # the most a request's prompt plus output may hold
    end_of_turn: list[int]  # chat requests stop there

    @property
    def llm(self) -> LLM:
        return self.engine.llm

    @staticmethod
    def of(engine: AsyncEngine, model_name: str, limits: ServerLimits) -> "Served":
        llm = engine.llm
        target = llm.engine.target
        capacity = target.blocks.num_blocks * target.block_size - llm.engine.decoder.lookahead
        return Served(engine, model_name, limits, min(llm.max_model_len, capacity), end_of_turn_ids(llm.tokenizer))

    def sampling(self, req: BaseRequest, kind: str, n_prompt: int, stop_ids: Sequence[int] = ()
                 ) -> list[SamplingParams]:
        """Each choice's settings (``stop_ids`` end it, besides EOS and a chat's end of turn); raises
        ``ValueError`` when prompt plus completion overflow the context."""
        asked = req.requested_max_tokens()
        if asked is None:  # OpenAI's default for completions, the rest of the context for chat
            default = COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else self.longest
            asked = max(1, min(default, self.longest - n_prompt))
        if n_prompt + asked > self.longest:
            raise ValueError(_context_error(self.longest, n_prompt, asked))
        stop_ids = [*stop_ids, *(self.end_of_turn if kind == "chat" else [])]
        return [req.sampling(c, asked, stop_ids) for c in range(req.n)]


def _context_error(longest: int, n_prompt: int, n_out: int) -> str:
    """vLLM's wording, so clients that parse it keep working."""
    return (f"This model's maximum context length is {longest} tokens. However, you requested {n_prompt + n_out} "
            f"tokens ({n_prompt} in the messages, {n_out} in the completion). Please reduce the length of the "
            "messages or completion.")


def _refusal(served: Served, req: BaseRequest, n_prompts: int):
    """The error response for a request refused as a whole, or None."""
    if req.model is not None and req.model != served.model_name:
        return error(f"model {req.model!r} is not served here; this server serves {served.model_name!r} "
                     "(GET /v1/models)", 404, code="model_not_found")
    try:
        req.check_supported()
    except UnsupportedField as e:
        return error(str(e))
    if n_prompts * req.n > served.limits.max_choices:
        return error(f"{n_prompts} prompts x n = {req.n} asks for {n_prompts * req.n} completions; this "
                     f"server allows at most {served.limits.max_choices} per request")
    return None


async def _grammar_refusal(served: Served, req: BaseRequest):
    """The 400 for a schema the grammar library refuses, or None; compiled off the event loop (the first one also
    indexes the vocabulary), and cached, so the engine's own compile is a look-up."""
    grammar = req.grammar()
    if grammar is None:
        return None
    try:
        await asyncio.to_thread(served.llm.engine.grammars.compile, grammar)
    except ValueError as e:
        return error(f"response_format: {e}")
    return None


async def run(served: Served, request: Request, req: BaseRequest, prompts: list[tuple[list[int], str | None]],
              kind: str, stop_ids: Sequence[int] = ()):
    """Submit every choice of every prompt, then stream or collect the answer."""
    refused = _refusal(served, req, len(prompts))
    if refused is None:
        refused = await _grammar_refusal(served, req)
    if refused is not None:
        return refused
    choices = Choices(served.engine)
    p = 0
    try:
        for p, (ids, text) in enumerate(prompts):
            for c, params in enumerate(served.sampling(req, kind, len(ids), stop_ids)):
                choices.submit(p * req.n + c, ids, params, text)
    except ServerClosing as e:
        choices.abort()
        return error(str(e), 503, "server_error")
    except ValueError as e:  # refused (too long, token ids outside the vocabulary, ...)
        choices.abort()
        return error((f"prompt {p}: " if len(prompts) > 1 else "") + str(e))
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    meta = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": served.model_name}
    tok = served.llm.tokenizer
    echo = None
    if isinstance(req, CompletionRequest) and req.echo:
        echo = [text if text is not None else tok.decode(ids, skip_special_tokens=req.skip_special_tokens)
                for ids, text in prompts]
    wants_logprobs = req.logprobs is not None if isinstance(req, CompletionRequest) else bool(req.logprobs)
    tools = None
    if isinstance(req, ChatRequest) and req.template_tools is not None:
        tools = "forced" if req.forced_tool_call else "auto"
    reply = Reply(kind, meta, [ids for ids, _ in prompts], tok, wants_logprobs, echo, req.include_usage, req.n, tools)
    if req.stream:
        return Stream(events(choices, reply), choices.abort)
    return await collect(request, choices, reply)


def add_openai_routes(app: FastAPI, served: Served) -> None:
    llm = served.llm

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                            "owned_by": "saguaro", "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            prompts = req.prompts()
        except ValueError as e:
            return error(str(e))
        if req.suffix is not None:
            return await _fill_in_the_middle(served, request, req, prompts)
        try:  # tokenized off the event loop; a prompt too long for the context is refused before that
            encoded = [(await served.engine.prompts.encode(p), p) if isinstance(p, str) else (list(p), None)
                       for p in prompts]
        except ValueError as e:
            return error(str(e))
        return await run(served, request, req, encoded, "completion")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        prompts = served.engine.prompts
        try:
            text = await prompts.render_chat([m.as_template_input() for m in req.messages], req.template_tools)
        except Exception as e:
            return error(f"chat template failed: {e}")
        try:
            ids = await prompts.encode(text, add_special_tokens=False)
        except ValueError as e:
            return error(str(e))
        return await run(served, request, req, [(ids, None)], "chat")


async def _fill_in_the_middle(served: Served, request: Request, req: CompletionRequest,
                              prompts: list[str | list[int]]):
    """Completions with a ``suffix``: each (string) prompt is the prefix; the model writes the middle."""
    tok = served.llm.tokenizer
    try:
        stops = FimTokens.of(tok).stops
    except NoFillInTheMiddle as e:
        return error(str(e))
    if not all(isinstance(p, str) for p in prompts):
        return error("suffix needs text prompts (the prefix), not token ids")
    encoder = served.engine.prompts
    try:  # the pieces tokenized off the event loop, a prefix and suffix too long for the context refused first
        encoded = []
        for p in prompts:
            encoder.check_length(p + req.suffix)
            encoded.append((await encoder.off_loop(fim_prompt, tok, p, req.suffix), p))
    except ValueError as e:
        return error(str(e))
    return await run(served, request, req, encoded, "completion", stops)
