"""The OpenAI request bodies the server accepts, and what each asks the engine for.

Fields follow OpenAI's API. Supported: ``prompt`` (a string, token ids, or a list of either),
``messages`` (text content), ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``top_k`` (an extension), ``stop``, ``seed``, ``n``, ``stream`` and
``stream_options.include_usage``; the logit processors ``frequency_penalty``, ``presence_penalty``,
``logit_bias`` and vLLM's ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``
(``saguaro.sampling.logit_processors``); logprobs (completions: ``logprobs: N`` and ``echo``, where
``max_tokens: 0`` scores the prompt alone; chat: ``logprobs`` and ``top_logprobs``), N at most
``MAX_LOGPROBS``; ``suffix`` (fill-in-the-middle, ``saguaro.server.fim``); ``response_format``
(``text``, ``json_object`` or ``json_schema``: the output is constrained to that JSON,
``saguaro.sampling.grammar``). Fields that would change the output in ways the engine cannot honour
(``best_of``) are refused with a 400 that names them, never silently ignored. Chat takes ``tools`` and
``tool_choice`` (``saguaro.server.tools``).

``n`` choices of one prompt are ``n`` engine requests; with a ``seed``, choice ``i`` uses
``seed + i`` (so they differ, and each is reproducible).

Limits, as OpenAI and vLLM set them: ``temperature`` in [0, 2], ``top_p`` in (0, 1], ``n`` in
1..128, ``top_k`` -1 (off), 0 (off) or a positive int32, ``seed`` and ``seed + n - 1`` within
int64. NaN and Infinity (which Python's JSON parser reads) and lone UTF-16 surrogates are refused
anywhere in the body. ``skip_special_tokens`` (default true, as vLLM) leaves special tokens out of
the text.
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from saguaro.sampling.grammar import JsonGrammar
from saguaro.server.tools import Tool, ToolChoice, call_grammar, check_choice, template_tools
from saguaro.sampling.params import (INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, TOP_K_MAX,
                                     SamplingParams)

MAX_N = 128
MAX_TEMPERATURE = 2.0


class UnsupportedField(ValueError):
    pass


class StreamOptions(BaseModel):
    include_usage: bool = False


def _check_values(x: Any) -> None:
    """Refuse what JSON cannot carry but Python's parser lets through: NaN, Infinity, lone surrogates."""
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("NaN and Infinity are not valid JSON numbers")
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone UTF-16 surrogate (e.g. \\ud800): send valid Unicode") from None
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_values(k)
            _check_values(v)
    elif isinstance(x, list):
        for v in x:
            _check_values(v)


class BaseRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI-compatible servers do

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=MAX_N)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_json_values(cls, data: Any) -> Any:
        _check_values(data)
        return data

    @model_validator(mode="after")
    def _seeds_fit(self) -> "BaseRequest":
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed: choice i uses seed + i, so seed + n - 1 must be <= {INT64_MAX}")
        return self

    @model_validator(mode="after")
    def _bias_keys_are_ids(self) -> "BaseRequest":
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {value!r} for token {key}")
        return self

    @model_validator(mode="after")
    def _known_format(self) -> "BaseRequest":
        self.grammar()
        return self

    def grammar(self) -> JsonGrammar | None:
        """What ``response_format`` constrains the output to; raises ``ValueError`` naming what is wrong."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return JsonGrammar()
        if kind != "json_schema":
            raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return JsonGrammar(json.dumps(spec["schema"]))

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _unsupported(self) -> dict[str, Any]:
        return {}

    def check_supported(self) -> None:
        used = [name for name, value in self._unsupported().items() if value is not None and value is not False]
        if used:
            one = len(used) == 1
            raise UnsupportedField(f"{', '.join(used)} {'is' if one else 'are'} not supported by this server; "
                                   f"leave {'it' if one else 'them'} unset")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_settings(self) -> dict[str, int | None]:
        """``logprobs`` and ``prompt_logprobs`` for the engine."""
        return {}

    def sampling(self, choice: int, default_max_tokens: int, stop_token_ids: list[int] | None = None
                 ) -> SamplingParams:
        """Engine parameters for choice ``choice`` (OpenAI's defaults: temperature 1, top_p 1)."""
        stop = [self.stop] if isinstance(self.stop, str) else [s for s in (self.stop or []) if s]
        max_tokens = self.requested_max_tokens()
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              max_tokens=default_max_tokens if max_tokens is None else max_tokens, stop=stop,
                              seed=None if self.seed is None else self.seed + choice,
                              stop_token_ids=list(stop_token_ids or []),
                              skip_special_tokens=self.skip_special_tokens, **self._processors(),
                              **self.logprob_settings(), grammar=self.grammar())

    def _processors(self) -> dict[str, Any]:
        return dict(frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                    min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)


class CompletionRequest(BaseRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _no_tokens_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for no tokens, which only makes sense with echo (the prompt's "
                             "logprobs); ask for at least 1")
        if self.suffix is not None and self.echo:
            raise ValueError("echo and suffix cannot be combined (a fill-in-the-middle prompt is not the text)")
        return self

    def _unsupported(self) -> dict[str, Any]:
        best_of = self.best_of if self.best_of not in (None, self.n) else None
        return {**super()._unsupported(), "best_of": best_of}

    def logprob_settings(self) -> dict[str, int | None]:
        prompt = self.logprobs if self.echo and self.logprobs is not None else 0 if self.max_tokens == 0 else None
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt}

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids; raises ``ValueError`` for an empty one."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise ValueError("prompt must not be empty")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn that called tools
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, as the server sent them
    tool_call_id: str | None = None  # a tool turn's answer to that call

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content (or, from the assistant, tool_calls)")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:  # templates (Qwen2.5's) write the arguments with tojson: give them the object
            out["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": _arguments(c)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: dict[str, Any]) -> Any:
    args = call.get("function", {}).get("arguments", {})
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


class ChatRequest(BaseRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _chat_limits(self) -> "ChatRequest":
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be at least 1")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        check_choice(self.tools, self.tool_choice)
        return self

    def grammar(self) -> JsonGrammar | None:
        """``response_format``'s, or one tool call's JSON for ``tool_choice`` "required" or a named function."""
        call = call_grammar(getattr(self, "tools", None), getattr(self, "tool_choice", None))
        if call is not None and super().grammar() is not None:
            raise ValueError("response_format cannot be combined with tool_choice 'required' or a named function")
        return call or super().grammar()

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools, self.tool_choice)

    @property
    def forced_tool_call(self) -> bool:
        return call_grammar(self.tools, self.tool_choice) is not None

    def logprob_settings(self) -> dict[str, int | None]:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
