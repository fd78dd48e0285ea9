"""The OpenAI-compatible server on loopback: completions, chat, streaming, malformed input (a 4xx JSON error
that touches no other request), concurrency, and clients that disconnect (their requests abort and free
their KV blocks at once)."""
import json
import threading

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
text_string_to_metric_families = pytest.importorskip("prometheus_client.parser").text_string_to_metric_families

from saguaro import LLM, SamplingParams  # noqa: E402
from tests.serving import chat_model, http, running_server  # noqa: E402

CONTEXT = 512  # the tiny model's context


@pytest.fixture(scope="module")
def server():
    with running_server(LLM(chat_model(), block_size=4, max_model_len=CONTEXT)) as s:
        with LLM(chat_model(), block_size=4, max_model_len=CONTEXT) as reference:
            yield s, reference


def post(url, body, stream=False):
    status, text = http(url, body if isinstance(body, (dict, bytes)) else json.dumps(body).encode())
    return status, text if stream else json.loads(text)


def test_models(server):
    status, body = http(server[0].url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"


def test_completion_matches_engine(server):
    s, reference = server
    status, body = post(s.url + "/v1/completions", {"prompt": "t1 t2 t3", "max_tokens": 8, "temperature": 0})
    assert status == 200
    expected = reference.generate(["t1 t2 t3"], SamplingParams(max_tokens=8))[0]
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == 8


def test_streaming_chat(server):
    s, _ = server
    request = {"messages": [{"role": "user", "content": "t4 t5"}], "max_tokens": 6, "temperature": 0}
    status, raw = post(s.url + "/v1/chat/completions", {**request, "stream": True}, stream=True)
    assert status == 200
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    status, body = post(s.url + "/v1/chat/completions", request)
    assert body["choices"][0]["message"]["content"] == text


MALFORMED = [  # (route, body, words the error message must contain)
    ("completions", b'{"prompt": "t1", "max_tokens": ', ["not valid JSON"]),
    ("completions", b"[1, 2]", ["invalid request"]),
    ("completions", {"max_tokens": 4}, ["prompt", "Field required"]),
    ("completions", {"prompt": 123}, ["prompt"]),
    ("completions", {"prompt": "t1", "max_tokens": "ten"}, ["max_tokens"]),
    ("completions", {"prompt": "t1", "temperature": "hot"}, ["temperature"]),
    ("completions", {"prompt": "t1", "stop": 5}, ["stop"]),
    ("completions", {"prompt": "t1", "stream": "sometimes"}, ["stream"]),
    ("completions", {"prompt": "t1", "max_tokens": -5}, ["max_tokens", "greater than or equal to 0"]),
    ("completions", {"prompt": "t1", "max_tokens": 0}, ["max_tokens", "echo"]),  # 0 only scores an echoed prompt
    ("chat/completions", {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 0}, ["max_tokens"]),
    ("completions", {"prompt": "t1", "logprobs": 21}, ["logprobs", "less than or equal to 20"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "t1"}], "logprobs": True, "top_logprobs": 21},
     ["top_logprobs"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "t1"}], "top_logprobs": 2}, ["needs logprobs"]),
    ("completions", {"prompt": "t1", "temperature": -1}, ["temperature"]),
    ("completions", {"prompt": "t1", "top_p": 0}, ["top_p"]),
    ("completions", {"prompt": "t1", "n": 0}, ["n"]),
    ("completions", {"prompt": ""}, ["empty"]),
    ("completions", {"prompt": []}, ["empty"]),
    ("completions", {"prompt": " ".join(["t1"] * (CONTEXT + 8)), "max_tokens": 4}, ["context"]),
    ("completions", {"prompt": ["t1", " ".join(["t2"] * (CONTEXT + 8))]}, ["prompt 1", "context"]),
    ("completions", {"prompt": [1, 2, 64], "max_tokens": 4}, ["token ids", "[0, 64)"]),
    ("completions", {"prompt": [1, -3], "max_tokens": 4}, ["token ids"]),
    ("chat/completions", {"messages": []}, ["messages", "at least 1"]),
    ("chat/completions", {"messages": "hello"}, ["messages"]),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "t1"}]}, ["role"]),
    ("chat/completions", {"messages": [{"role": "user"}]}, ["content"]),
]


def test_malformed_input_gets_a_4xx_json_error_and_touches_no_other_request(server):
    s, reference = server
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    expected = reference.generate(["t3 t1"], SamplingParams(max_tokens=60))[0].text
    stream = client.completions.create(model="tiny", prompt="t3 t1", max_tokens=60, temperature=0, stream=True)
    text = ""
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 0:  # while this request decodes, send every malformed one
            for route, body, words in MALFORMED:
                status, raw = http(f"{s.base_url}/{route}", body if isinstance(body, bytes) else body)
                error = json.loads(raw)["error"]
                assert 400 <= status < 500 and error["type"] == "invalid_request_error", (body, status, raw)
                assert all(w in error["message"] for w in words), (body, error["message"])
    assert text == expected
    assert s.idle()  # nothing half-admitted is left holding blocks
    status, raw = http(s.url + "/v1/nowhere")
    assert status == 404 and "error" in json.loads(raw)


def test_concurrent_requests(server):
    s, _ = server
    results = []

    def one(i):
        results.append(post(s.url + "/v1/completions", {"prompt": f"t{i} t2", "max_tokens": 5, "temperature": 0}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(status == 200 and body["usage"]["completion_tokens"] == 5 for status, body in results)


def _counter(url: str, name: str, labels: dict | None = None) -> float:
    text = http(url + "/metrics")[1]
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()))


def test_dropped_streams_abort_and_free_their_blocks(server):
    """8 streams; 4 are dropped after two chunks. The dropped ones abort (they would run 400 tokens), the
    other 4 finish exactly as they do alone, and every KV block is free again."""
    s, reference = server
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    kept = [dict(prompt="t5 t6", temperature=0), dict(prompt="t7", temperature=1.0, seed=3),
            dict(prompt="t8 t9 t10", temperature=0), dict(prompt="t11", temperature=0.7, seed=4)]
    aborted_before = _counter(s.url, "saguaro:request_success_total", {"finished_reason": "abort"})
    tokens_before = _counter(s.url, "saguaro:generation_tokens_total")
    streams = []
    for i in range(8):
        request = kept[i // 2] if i % 2 else dict(prompt=f"t{i + 20} t2", temperature=0)
        streams.append((i % 2 == 1, request, client.completions.create(
            model="tiny", max_tokens=30 if i % 2 else 400, stream=True, **request)))
    started = []
    for keep, _, stream in streams:
        started.append("".join(chunk.choices[0].text for _, chunk in zip(range(2), stream)))
        if not keep:
            stream.close()  # the client hangs up mid-stream
    for (keep, request, stream), begun in zip(streams, started):
        if keep:
            text = begun + "".join(c.choices[0].text for c in stream)
            params = SamplingParams(max_tokens=30, temperature=request["temperature"], seed=request.get("seed"))
            assert text == reference.generate([request["prompt"]], params)[0].text
    assert s.idle()
    assert _counter(s.url, "saguaro:request_success_total", {"finished_reason": "abort"}) - aborted_before == 4
    assert _counter(s.url, "saguaro:generation_tokens_total") - tokens_before < 4 * 30 + 4 * 400
