"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

Evaluation clients count tokens themselves: lm-evaluation-harness's ``local-completions`` sends token-id
prompts and cuts each scored text at its context's length in tokens. With these routes it tokenizes
through the server (its ``remote`` tokenizer, which it picks by itself when ``/tokenizer_info`` and
``/tokenize`` answer), so it needs no copy of the model's tokenizer, which a GGUF model does not ship
in a form ``transformers`` loads. Text is tokenized on the prompt encoder's threads, without the
context's length bound: a client may tokenize a document to cut it into windows.

- ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true}`` (the chat template) -> ``{"tokens", "count", "max_model_len"}``.
- ``/detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``; an id outside the vocabulary is a 400.
- ``/tokenizer_info``: the special tokens (``eos_token``, ``bos_token``, ``pad_token``), the chat template,
  ``vocab_size`` and ``max_model_len``.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, model_validator

from saguaro.server.openai_routes import Served
from saguaro.server.responses import error
from saguaro.server.schemas import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template's own)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a chat), not both or neither")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, served: Served) -> None:
    tok = served.llm.tokenizer
    encoder = served.engine.prompts

    def other_model(name: str | None):
        if name is not None and name != served.model_name:
            return error(f"model {name!r} is not served here; this server serves {served.model_name!r}", 404,
                         code="model_not_found")
        return None

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if (refused := other_model(req.model)) is not None:
            return refused
        text, special = req.prompt, req.add_special_tokens
        if req.messages is not None:
            try:
                text = await encoder.off_loop(tok.apply_chat_template, [m.as_template_input() for m in req.messages],
                                              req.add_generation_prompt)
            except Exception as e:  # the template's own error, as /v1/chat/completions reports it
                return error(f"chat template failed: {e}")
            special = bool(special)
        tokens = await encoder.off_loop(tok.encode_nogil, text, True if special is None else special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": served.llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if (refused := other_model(req.model)) is not None:
            return refused
        if bad := [t for t in req.tokens if not 0 <= t < tok.vocab_size]:
            return error(f"tokens must lie in [0, {tok.vocab_size}); got {bad[0]}")
        return {"prompt": await encoder.off_loop(tok.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {"tokenizer_class": "saguaro", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": None, "chat_template": tok.chat_template, "vocab_size": tok.vocab_size,
                "max_model_len": served.llm.max_model_len}
