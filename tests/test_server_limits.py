"""The server's limits and deadlines: every out-of-range setting is a JSON 4xx in OpenAI's error shape (never a
500), extreme but valid settings are served beside healthy streams that stay exact, special tokens stay out of
the text and the chat end-of-turn token ends the answer, slow bodies get a 408, ``/health`` is 503 while the
engine is stalled, and the shutdown deadline aborts what is still running (and stops the SSD speculator)."""
import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
pytest.importorskip("uvicorn")

from saguaro import LLM, SamplingParams  # noqa: E402
from saguaro.engine.llm_engine import LLMEngine  # noqa: E402
from saguaro.server.lifecycle import ServerLimits  # noqa: E402
from tests.serving import chat_model, http, running_server  # noqa: E402
from tests.tiny import weak_pair  # noqa: E402

CONTEXT = 128
LIMITS = ServerLimits(max_choices=8, body_timeout_s=0.5, shutdown_timeout_s=1.0, health_stall_s=0.5)


@pytest.fixture(scope="module")
def server():
    with running_server(LLM(chat_model(), block_size=4, max_model_len=CONTEXT), limits=LIMITS) as s:
        with LLM(chat_model(), block_size=4, max_model_len=CONTEXT) as reference:
            yield s, reference


def _context(n_prompt: int, n_out: int) -> str:
    return (f"This model's maximum context length is {CONTEXT} tokens. However, you requested {n_prompt + n_out} "
            f"tokens ({n_prompt} in the messages, {n_out} in the completion). Please reduce the length of the "
            "messages or completion.")


REFUSED = [  # (route, body, words the error message must contain)
    ("completions", {"prompt": "t1", "temperature": 2.5}, ["temperature", "less than or equal to 2"]),
    ("completions", {"prompt": "t1", "top_p": 1.5}, ["top_p"]),
    ("completions", {"prompt": "t1", "top_p": 0}, ["top_p"]),
    ("completions", {"prompt": "t1", "n": 129}, ["n:", "128"]),
    ("completions", {"prompt": "t1", "top_k": -2}, ["top_k"]),
    ("completions", {"prompt": "t1", "top_k": 9223372036854775808}, ["top_k"]),
    ("completions", {"prompt": "t1", "seed": 2**70}, ["seed"]),
    ("completions", {"prompt": "t1", "seed": 2**63 - 1, "n": 2}, ["seed + n - 1"]),
    ("completions", b'{"prompt": "t1", "temperature": NaN}', ["NaN"]),
    ("completions", b'{"prompt": "t1", "top_p": Infinity}', ["NaN and Infinity"]),
    ("completions", b'{"prompt": "t1", "whatever": -Infinity}', ["NaN and Infinity"]),
    ("completions", b'{"prompt": "Hello \\ud800", "max_tokens": 2}', ["surrogate"]),
    ("completions", b'{"prompt": "t1", "stop": ["\\udfff"]}', ["surrogate"]),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', ["surrogate"]),
    ("completions", {"prompt": "t1 t2 t3", "max_tokens": CONTEXT}, [_context(3, CONTEXT)]),
    ("completions", {"prompt": " ".join(["t1"] * CONTEXT)}, ["maximum context length"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 10**30},
     ["maximum context length", "in the completion"]),
    ("completions", {"prompt": ["t1", "t2", "t3"], "n": 3}, ["9 completions", "at most 8"]),
]


def test_out_of_range_settings_are_json_4xx(server):
    s, _ = server
    for route, body, words in REFUSED:
        status, raw = http(f"{s.base_url}/{route}", body)
        error = json.loads(raw)["error"]
        assert 400 <= status < 500 and error["type"] == "invalid_request_error", (body, status, raw)
        assert all(w in error["message"] for w in words), (body, error["message"])
    assert s.idle()


EXTREME = [dict(temperature=1e-45), dict(temperature=2.0, top_p=1e-45), dict(top_k=2**31 - 1, temperature=1.0),
           dict(top_k=-1, temperature=1.0, seed=2**63 - 2, n=2), dict(seed=-2**63, temperature=0.5),
           dict(max_tokens=CONTEXT - 3)]


def test_extreme_valid_settings_run_beside_exact_streams(server):
    s, reference = server
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=11)
    expected = reference.generate(["t3 t1"], params)[0].text
    stream = client.completions.create(model="tiny", prompt="t3 t1", max_tokens=40, temperature=0.9, seed=11,
                                       stream=True)
    text = ""
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 0:
            for extra in EXTREME:
                fields = {k: v for k, v in extra.items() if k != "top_k"}
                extra_body = {"top_k": extra["top_k"]} if "top_k" in extra else None
                out = client.completions.create(model="tiny", prompt="t2 t5 t9", extra_body=extra_body,
                                                **{"max_tokens": 4, **fields})
                assert all(c.finish_reason in ("stop", "length") for c in out.choices), extra
    assert text == expected
    assert s.idle()


def _turn_template(marker: str) -> str:
    return "{% for m in messages %}{{ m['content'] }} " + marker + " {% endfor %}"


def test_special_tokens_and_end_of_turn():
    """The chat template ends a turn with a special token the model does produce: the answer stops there and
    the marker is not in the content; completions keep special tokens out of the text unless asked."""
    loaded = chat_model(seed=2)
    tok, messages = loaded.tokenizer, [{"role": "user", "content": "t4 t5"}]
    with LLM(loaded, block_size=4, max_model_len=CONTEXT) as llm:
        for m in range(64):  # a marker that the model writes (not first) after the prompt the template makes
            ids = tok.encode(f"t4 t5 t{m} ")
            alone = llm.generate(ids, SamplingParams(max_tokens=12))[0].token_ids
            if m in alone[1:]:
                break
    marker, cut = f"t{m}", alone.index(m)
    tok.chat_template = _turn_template(marker)  # before its first use: the tokenizer compiles it once
    assert tok.encode_chat(messages) == ids
    tok.backend.add_special_tokens([marker])
    with running_server(LLM(loaded, block_size=4, max_model_len=CONTEXT)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        shown = client.completions.create(model="tiny", prompt=ids, max_tokens=cut + 1, temperature=0)
        raw = client.completions.create(model="tiny", prompt=ids, max_tokens=cut + 1, temperature=0,
                                        extra_body={"skip_special_tokens": False})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == cut + 1
    assert reply.choices[0].message.content == tok.decode(alone[:cut])
    assert shown.choices[0].text == tok.decode(alone[:cut])  # the marker is special: left out of the text
    assert raw.choices[0].text.split()[-1] == marker


def test_slow_body_gets_408(server):
    s, _ = server
    port = int(s.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        start = time.monotonic()
        reply = b""
        while b"did not arrive" not in reply and (piece := sock.recv(4096)):
            reply += piece
        waited = time.monotonic() - start
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive" in reply
    assert waited < LIMITS.body_timeout_s + 5


def test_health_is_503_while_the_engine_is_stalled(server, monkeypatch):
    s, _ = server
    assert http(s.url + "/health")[0] == 200
    real, slowed = LLMEngine.step, threading.Event()

    def slow(self):
        if not slowed.is_set():
            slowed.set()
            time.sleep(3 * LIMITS.health_stall_s)
        return real(self)
    monkeypatch.setattr(LLMEngine, "step", slow)
    done = threading.Thread(target=http, args=(s.base_url + "/completions", {"prompt": "t1", "max_tokens": 2}))
    done.start()
    slowed.wait(10)
    time.sleep(1.5 * LIMITS.health_stall_s)
    status, body = http(s.url + "/health")
    done.join(30)
    assert status == 503 and json.loads(body)["status"] == "stalled"
    assert http(s.url + "/health")[0] == 200


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_shutdown_deadline_aborts_running_streams(monkeypatch, mode):
    """SIGTERM's path: streams still running at the deadline end with finish_reason "abort" and [DONE], and
    the engine closes (in SSD its speculator thread is gone; the process transport closes by the same
    ``LLM.close``, covered in tests/test_ssd.py)."""
    real = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: (time.sleep(0.02), real(self))[1])  # 400 tokens: > 8 s
    if mode == "ssd":
        target, draft = weak_pair()
        llm = LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=3, fan_out=[1, 1, 1, 2],
                  block_size=4, speculator_transport="thread", enforce_eager=True)
    else:
        llm = LLM(chat_model(), block_size=4, max_model_len=CONTEXT * 4)
    link = getattr(llm.engine.decoder, "link", None)
    with running_server(llm, limits=LIMITS) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="t1 t2", max_tokens=400, temperature=0,
                                           stream=True)
        first = next(iter(stream))
        start = time.monotonic()
        s.server.should_exit = True  # what uvicorn's SIGTERM handler does
        last = first
        for last in stream:
            pass
        waited = time.monotonic() - start
    assert last.choices[0].finish_reason == "abort"
    assert LIMITS.shutdown_timeout_s - 0.2 < waited < LIMITS.shutdown_timeout_s + 5
    if link is not None:
        link.thread.join(10)
        assert not link.thread.is_alive() and llm.engine.decoder.link is None


SERVE_SCRIPT = """
import sys, time
from saguaro import LLM
from saguaro.engine.llm_engine import LLMEngine
from saguaro.server.app import serve
from saguaro.server.lifecycle import ServerLimits
from tests.serving import chat_model
real = LLMEngine.step
LLMEngine.step = lambda self: (time.sleep(0.02), real(self))[1]
llm = LLM(chat_model(), block_size=4)
closed = llm.close
llm.close = lambda: (print("engine closed", flush=True), closed())
serve(llm, "tiny", port=int(sys.argv[1]), limits=ServerLimits(shutdown_timeout_s=1.0))
"""


def _up(url: str) -> bool:
    try:
        return http(url)[0] == 200
    except OSError:  # not listening yet
        return False


def test_sigterm_ends_streams_with_abort_and_exits():
    """The real signal path: ``serve`` in its own process, SIGTERM while a stream runs."""
    import os
    import signal
    import subprocess
    import sys

    from saguaro.workers.process import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(port)], cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _up(f"http://127.0.0.1:{port}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="t1 t2", max_tokens=400, temperature=0, stream=True)
        last = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        for last in stream:
            pass
        assert last.choices[0].finish_reason == "abort"
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
        assert "engine closed" in proc.stdout.read()  # before the signal ended the process
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
