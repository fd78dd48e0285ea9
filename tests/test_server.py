"""The OpenAI-compatible server on loopback: completions, chat, streaming, errors, concurrency."""
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import uvicorn

from saguaro import LLM, SamplingParams
from saguaro.server.app import create_app
from saguaro.server.async_engine import AsyncEngine
from saguaro.ssd.channel import free_port
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def server():
    loaded = tiny_model(seed=1)
    loaded.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                                      "{% if add_generation_prompt %}t9{% endif %}")
    llm = LLM(loaded, block_size=4, max_model_len=64)
    reference = LLM(tiny_model(seed=1), block_size=4, max_model_len=64)
    engine = AsyncEngine(llm)
    port = free_port()
    config = uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", reference
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def post(url, body, stream=False):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            return r.status, raw if stream else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_models(server):
    with urllib.request.urlopen(server[0] + "/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"


def test_completion_matches_engine(server):
    url, reference = server
    status, body = post(url + "/v1/completions", {"prompt": "t1 t2 t3", "max_tokens": 8, "temperature": 0})
    assert status == 200
    expected = reference.generate(["t1 t2 t3"], SamplingParams(max_tokens=8))[0]
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == 8


def test_streaming_chat(server):
    url, _ = server
    status, raw = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "t4 t5"}],
                                                      "max_tokens": 6, "temperature": 0, "stream": True}, stream=True)
    assert status == 200
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    status, body = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "t4 t5"}],
                                                       "max_tokens": 6, "temperature": 0})
    assert body["choices"][0]["message"]["content"] == text


def test_bad_requests_get_clear_errors_and_others_continue(server):
    url, _ = server
    status, body = post(url + "/v1/completions", {"prompt": "t1", "temperature": -1})
    assert status == 422 or (status == 400 and "temperature" in body["error"]["message"])
    status, body = post(url + "/v1/completions", {"prompt": " ".join(["t1"] * 80), "max_tokens": 4})
    assert status == 400 and "context" in body["error"]["message"]
    results = []

    def one(i):
        results.append(post(url + "/v1/completions", {"prompt": f"t{i} t2", "max_tokens": 5, "temperature": 0}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(status == 200 and body["usage"]["completion_tokens"] == 5 for status, body in results)
