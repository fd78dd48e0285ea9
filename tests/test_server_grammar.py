"""``response_format`` through the server with the official ``openai`` client: a schema-constrained chat gives
JSON that validates, and greedy outputs of AR, SD and SSD servers are equal; streams equal whole answers; bad
formats and schemas get a 400 naming the problem."""
import dataclasses
import json

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
jsonschema = pytest.importorskip("jsonschema")

from saguaro import LLM  # noqa: E402
from saguaro.loading.tokenizer import Tokenizer  # noqa: E402
from tests.serving import CHAT_TEMPLATE, running_server  # noqa: E402
from tests.tiny import byte_level_bpe, tiny_model, truncated  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]},
                                           "tag": {"enum": ["a", "bc", "Hello"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Hello world"}]


def json_model():
    """A tiny model with a byte-level BPE tokenizer (any JSON has tokens), a special EOS and a chat template."""
    backend = byte_level_bpe().backend
    backend.add_special_tokens(["<|end|>"])
    tokenizer = Tokenizer(backend, [backend.token_to_id("<|end|>")], chat_template=CHAT_TEMPLATE)
    return dataclasses.replace(tiny_model(seed=3, vocab=tokenizer.vocab_size), tokenizer=tokenizer)


def _engines():
    """A fresh model per engine: a rendered chat template is cached on the tokenizer, and SSD's worker takes a copy
    of the model that must not hold one."""
    yield "ar", LLM(json_model(), block_size=4, max_model_len=128)
    target = json_model()
    yield "sd", LLM(target=target, draft=truncated(target, 1), mode="sd", num_speculative_tokens=3, block_size=4,
                    max_model_len=128)
    target = json_model()
    yield "ssd", LLM(target=target, draft=truncated(target, 1), mode="ssd", num_speculative_tokens=3,
                     fan_out=[2, 2, 2, 4], worker_timeout_s=60, block_size=4, max_model_len=128)


def _ask(client, **kw):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=48, **kw)


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
            out[mode] = (whole.message.content, whole.finish_reason, stream, completion.choices[0].text)
            if mode == "ar":
                out["errors"] = _errors(client)
                out["plain"] = _ask(client).choices[0].message.content
    return out


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
    text, reason, stream, _ = answers["ar"]
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
