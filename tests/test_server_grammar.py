"""``response_format`` and tools through the server with the official ``openai`` client: a schema-constrained chat gives
JSON that validates, and greedy outputs of AR, SD and SSD servers are equal; streams equal whole answers; bad
formats and schemas get a 400 naming the problem. Tools: a required or named call comes back as ``tool_calls``
whose arguments validate, streamed too; Qwen2.5's ``<tool_call>`` blocks are parsed."""
import dataclasses
import json

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
jsonschema = pytest.importorskip("jsonschema")

from saguaro import LLM  # noqa: E402
from saguaro.loading import MODELS, installed, load_model  # noqa: E402
from saguaro.loading.tokenizer import Tokenizer  # noqa: E402
from saguaro.server.schemas import ChatMessage  # noqa: E402
from saguaro.server.tools import parse_tool_calls  # noqa: E402
from tests.serving import running_server  # noqa: E402
from tests.tiny import byte_level_bpe, tiny_model, truncated  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]},
                                           "tag": {"enum": ["a", "bc", "Hello"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Hello world"}]
CHAT_TEMPLATE = ("{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"  # the tools' names, as Qwen2.5's
                 "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t9{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def json_model():
    """A tiny model with a byte-level BPE tokenizer (any JSON has tokens), a special EOS and a chat template."""
    backend = byte_level_bpe().backend
    backend.add_special_tokens(["<|end|>"])
    tokenizer = Tokenizer(backend, [backend.token_to_id("<|end|>")], chat_template=CHAT_TEMPLATE)
    return dataclasses.replace(tiny_model(seed=3, vocab=tokenizer.vocab_size), tokenizer=tokenizer)


def _engines():
    """A fresh model per engine: a rendered chat template is cached on the tokenizer, and SSD's worker takes a copy
    of the model that must not hold one."""
    yield "ar", LLM(json_model(), block_size=4, max_model_len=256)
    target = json_model()
    yield "sd", LLM(target=target, draft=truncated(target, 1), mode="sd", num_speculative_tokens=3, block_size=4,
                    max_model_len=256)
    target = json_model()
    yield "ssd", LLM(target=target, draft=truncated(target, 1), mode="ssd", num_speculative_tokens=3,
                     fan_out=[2, 2, 2, 4], worker_timeout_s=60, block_size=4, max_model_len=256)


def _ask(client, **kw):
    kw.setdefault("max_tokens", 48 if "tools" not in kw else 100)  # a call's JSON takes ~40 tokens here
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, **kw)


@pytest.fixture(scope="module")
def answers():
    """Per mode: the schema chat, its stream's text, and a json_object completion."""
    out = {}
    for mode, llm in _engines():
        with running_server(llm) as served:
            client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60)
            whole = _ask(client, response_format=FORMAT).choices[0]
            stream = "".join(c.choices[0].delta.content or "" for c in _ask(client, response_format=FORMAT,
                                                                            stream=True) if c.choices)
            completion = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=48, temperature=0,
                                                   extra_body={"response_format": {"type": "json_object"}})
            call = _ask(client, tools=TOOLS, tool_choice="required").choices[0]
            out[mode] = (whole.message.content, whole.finish_reason, stream, completion.choices[0].text,
                         call.finish_reason, [(c.function.name, c.function.arguments) for c in call.message.tool_calls])
            if mode == "ar":
                out["tools"] = _tool_answers(client)
                out["errors"] = _errors(client)
                out["plain"] = _ask(client).choices[0].message.content
    return out


def _tool_answers(client) -> dict:
    named = _ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _ask(client, tools=TOOLS, tool_choice="required", stream=True):
        for c in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    auto, none = (_ask(client, tools=TOOLS, tool_choice=choice, max_tokens=4) for choice in ("auto", "none"))
    errors = []
    for kw in ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
               {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
               {"tool_choice": "required"}):
        with pytest.raises(openai.BadRequestError) as e:
            _ask(client, **kw)
        errors.append(str(e.value))
    return {"named": named.choices[0], "stream": (list(calls.values()), finish), "auto": auto, "none": none,
            "errors": errors}


def _errors(client) -> list[str]:
    bad = [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}]
    messages = []
    for fmt in bad:
        with pytest.raises(openai.BadRequestError) as e:
            _ask(client, response_format=fmt)
        messages.append(str(e.value))
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, response_format=FORMAT, extra_body={"ignore_eos": True})
    return messages + [str(e.value)]


def test_schema_chat_validates_and_modes_agree(answers):
    text, reason, stream = answers["ar"][:3]
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert stream == text
    assert answers["plain"] != text  # the format changes the output: the equality below has teeth
    for mode in ("sd", "ssd"):
        assert answers[mode] == answers["ar"], mode


def test_json_object_completion(answers):
    assert isinstance(json.loads(answers["ar"][3]), dict)


def test_bad_formats_are_refused(answers):
    wrong_type, no_spec, bad_spec, refused, with_ignore_eos = answers["errors"]
    assert "'json_object' or 'json_schema'" in wrong_type
    assert "json_schema needs" in no_spec and "json_schema needs" in bad_spec
    assert "cannot be compiled" in refused
    assert "ignore_eos" in with_ignore_eos


def test_required_tool_call_validates_and_modes_agree(answers):
    finish, calls = answers["ar"][4:]
    assert finish == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(arguments), parameters[name])
    assert answers["tools"]["stream"] == ([{"name": name, "arguments": arguments}], "tool_calls")


def test_named_tool_and_choices(answers):
    named = answers["tools"]["named"]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    auto, none = answers["tools"]["auto"], answers["tools"]["none"]
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens  # the template rendered the tools for "auto" only
    assert none.choices[0].message.tool_calls is None


def test_bad_tools_are_refused(answers):
    malformed, unknown, without = answers["tools"]["errors"]
    assert "name" in malformed
    assert "'nope', which is not among the tools" in unknown
    assert "needs tools" in without


def test_qwen_tool_call_blocks_are_parsed():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, forced=False)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Lima", "days": 2}),
                                                                   ("get_time", {"zone": "UTC"})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", forced=False) == (
        "<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls("plain words", forced=False) == ("plain words", [])


@pytest.mark.slow
@pytest.mark.skipif(not installed(MODELS["qwen2.5-coder-0.5b"]), reason=MODELS["qwen2.5-coder-0.5b"].pip_command)
def test_qwen_calls_a_tool_and_answers_in_json():
    """Qwen2.5's own template renders the tools and a required call comes back as tool_calls (this 0.5B coder
    answers "auto" with a fenced block rather than <tool_call>); a schema holds on a real vocabulary."""
    with running_server(LLM(load_model("qwen2.5-coder-0.5b", progress=False), max_model_len=1024)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "What is the weather in Paris for the next 2 days?"}]
        auto = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=64).choices[0]
        person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                   "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Invent a person; answer in JSON."}], temperature=0,
            max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
    assert auto.finish_reason == "tool_calls", auto.message
    (call,) = auto.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    jsonschema.validate(json.loads(answer.choices[0].message.content), person)


def test_tool_turns_reach_the_template():
    """An assistant turn's calls reach the template with their arguments as objects (Qwen2.5's writes them with
    tojson), a tool turn keeps its call id, and a turn with neither content nor calls is refused."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    turn = ChatMessage(role="assistant", tool_calls=[call]).as_template_input()
    assert turn["content"] == "" and turn["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert ChatMessage(role="tool", content="12:00", tool_call_id="call_1").as_template_input() == {
        "role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    with pytest.raises(ValueError, match="needs content"):
        ChatMessage(role="user")
