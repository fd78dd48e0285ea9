"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info): the model's own tokenizer over HTTP, what
lm-evaluation-harness's remote tokenizer reads; bad input is a 400 and the API key guards them."""
import json

import pytest

from saguaro import LLM
from tests.serving import chat_model, http, running_server


@pytest.fixture(scope="module")
def server():
    loaded = chat_model(eos=63)
    with LLM(loaded, block_size=4) as llm, running_server(llm) as s:
        yield s, loaded.tokenizer, llm.max_model_len


def post(s, path: str, body: dict) -> tuple[int, dict]:
    status, text = http(s.url + path, body)
    return status, json.loads(text)


def test_tokenize_a_prompt_and_a_chat(server):
    s, tok, longest = server
    status, out = post(s, "/tokenize", {"prompt": "t1 t2 t3", "add_special_tokens": False})
    assert status == 200 and out == {"tokens": [1, 2, 3], "count": 3, "max_model_len": longest}
    messages = [{"role": "user", "content": "t4 t5"}]
    status, out = post(s, "/tokenize", {"messages": messages, "model": "tiny"})
    assert status == 200 and out["tokens"] == tok.encode_chat(messages) == [4, 5, 9]
    status, out = post(s, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert out["tokens"] == [4, 5]
    long = " ".join(f"t{i % 60}" for i in range(2 * longest))  # a document longer than the context: still counted
    assert post(s, "/tokenize", {"prompt": long})[1]["count"] == 2 * longest


def test_detokenize_and_tokenizer_info(server):
    s, tok, longest = server
    status, out = post(s, "/detokenize", {"tokens": [1, 2, 3]})
    assert status == 200 and out == {"prompt": tok.decode([1, 2, 3])}
    status, text = http(s.url + "/tokenizer_info")
    info = json.loads(text)
    assert status == 200 and info["eos_token"] == tok.eos_token == "t63" and info["bos_token"] is None
    assert info["chat_template"] == tok.chat_template and info["max_model_len"] == longest


@pytest.mark.parametrize("path, body, message", [
    ("/tokenize", {"prompt": "t1", "messages": [{"role": "user", "content": "t1"}]}, "either prompt"),
    ("/tokenize", {}, "either prompt"),
    ("/tokenize", {"prompt": "t1", "model": "other"}, "not served here"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 64]}, "tokens must lie in [0, 64); got 64"),
    ("/detokenize", {"tokens": [-1]}, "got -1"),
])
def test_bad_input_is_a_400_naming_it(server, path, body, message):
    s = server[0]
    status, out = post(s, path, body)
    assert status == (404 if "served" in message else 400) and message in out["error"]["message"], out
    assert post(s, "/tokenize", {"prompt": "t1"})[0] == 200  # the server goes on


def test_the_api_key_guards_them():
    with LLM(chat_model(), block_size=4) as llm, running_server(llm, api_key="k") as s:
        assert http(s.url + "/tokenize", {"prompt": "t1"})[0] == 401
        assert http(s.url + "/tokenizer_info")[0] == 401
        assert http(s.url + "/tokenizer_info", headers={"Authorization": "Bearer k"})[0] == 200
