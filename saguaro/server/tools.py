"""Tools on chat: what the template sees, what the output is constrained to, and the tool calls parsed back.

``tool_choice``:

* ``"none"``: the template renders no tools and nothing is parsed;
* ``"auto"`` (the default with tools): the template renders the tools (Qwen2.5's writes them into the
  system turn) and the model may answer with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, which become ``tool_calls``; the text outside them stays the content;
* ``"required"`` or a named function: the output is constrained (``saguaro.sampling.grammar``) to one
  call's JSON, ``{"name": ..., "arguments": ...}``, with the arguments per the function's ``parameters``
  schema, so it always parses.

A choice that called a tool ends with ``finish_reason: "tool_calls"``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from saguaro.sampling.grammar import JsonGrammar

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def check_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """Raise ``ValueError`` for a ``tool_choice`` the tools cannot satisfy."""
    if choice in (None, "none", "auto"):
        return
    if not tools:
        raise ValueError("tool_choice 'required' or a named function needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")


def template_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict[str, Any]] | None:
    """The tools the chat template renders (None: none, as with ``tool_choice: "none"``)."""
    if not tools or choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def call_grammar(tools: list[Tool] | None, choice: ToolChoice | None) -> JsonGrammar | None:
    """For ``required`` or a named function: one call's JSON, per the chosen functions' parameter schemas."""
    if not tools or choice in (None, "none", "auto"):
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    options = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                 "arguments": t.function.parameters or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools if named in (None, t.function.name)]
    return JsonGrammar(json.dumps(options[0] if len(options) == 1 else {"anyOf": options}))


def _call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, forced: bool) -> tuple[str | None, list[ToolCall]]:
    """The content and the tool calls of an output: the whole text is one call when ``forced`` (the grammar
    made it so); otherwise each well-formed ``<tool_call>`` block is one, and the rest is the content."""
    if forced:
        call = _call(text)
        return (None, [call]) if call is not None else (text, [])
    calls, kept, last = [], [], 0
    for m in TOOL_CALL.finditer(text):
        call = _call(m.group(1))
        if call is not None:
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
