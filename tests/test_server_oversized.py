"""An oversized request costs the server next to nothing: while two streams run, a 50 MB body (declared, then
chunked) gets a 413 without being read, and a 10 MB prompt is refused before it is tokenized; the streams never
wait 1 s for a token and the server's resident memory grows by less than 200 MB. The server runs in its own
process (its memory is its own) on a tiny model with a byte-level BPE tokenizer, slowed so that the streams
outlast the oversized requests. A gap bound is what not blocking means; 1 s is many times a step here."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
pytest.importorskip("uvicorn")

from tests.serving import http  # noqa: E402

MiB = 1 << 20
LIMIT = 16 * MiB  # over the 10 MB prompt, so that the character bound is what refuses it

SERVE_SCRIPT = f"""
import sys, time
from saguaro import LLM
from saguaro.engine.llm_engine import LLMEngine
from saguaro.server.app import serve
from saguaro.server.lifecycle import ServerLimits
from tests.tiny import byte_level_model
real = LLMEngine.step
LLMEngine.step = lambda self: (time.sleep(0.05), real(self))[1]  # the streams outlast the big requests
serve(LLM(byte_level_model(), block_size=4, max_model_len=256), "tiny", port=int(sys.argv[1]),
      limits=ServerLimits(max_request_bytes={LIMIT}))
"""


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak since the last reset) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


@pytest.fixture(scope="module")
def server():
    from saguaro.workers.process import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(port)], cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


def _raw(port: int, head: bytes, body_chunks, read_first: bool = False) -> tuple[str, int]:
    """Send ``head`` then the body chunks (stopping when the server stops taking them); (reply, bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        sock.settimeout(0.5 if read_first else 5)
        for chunk in body_chunks:
            if read_first:
                break
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except OSError:  # the server answered and closed: it reads no further
                break
        sock.settimeout(30)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply and (piece := sock.recv(65536)):
                reply += piece
        except OSError:
            pass
    return reply.decode(errors="replace"), sent


def _stream(port: int, arrivals: list[float]) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in client.completions.create(model="tiny", prompt="Hello world", max_tokens=240, temperature=0,
                                       stream=True):
        arrivals.append(time.monotonic())


def test_oversized_requests_cost_nothing(server):
    proc, port = server
    assert http(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "Hello", "max_tokens": 4})[0] == 200  # warm
    _reset_peak(proc.pid)
    before = _memory(proc.pid)["VmRSS"]
    arrivals = [[], []]
    streams = [threading.Thread(target=_stream, args=(port, a)) for a in arrivals]
    for t in streams:
        t.start()
    while min(len(a) for a in arrivals) < 5:  # both streams are running
        time.sleep(0.01)
    start = time.monotonic()

    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    declared, _ = _raw(port, post + f"Content-Length: {50 * MiB}\r\n\r\n".encode(), [b"x"], read_first=True)
    assert declared.startswith("HTTP/1.1 413"), declared
    piece = b"%x\r\n%s\r\n" % (MiB, b" " * MiB)
    chunked, sent = _raw(port, post + b"Transfer-Encoding: chunked\r\n\r\n", [piece] * 50)
    assert chunked.startswith("HTTP/1.1 413") and sent < 50 * MiB, (chunked, sent)
    prompt = "Hello world, hello saguaro! " * (10 * MiB // 28)
    status, body = http(f"http://127.0.0.1:{port}/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 400 and "maximum context length is 256 tokens" in json.loads(body)["error"]["message"]
    end = time.monotonic()

    for t in streams:
        t.join(120)
    memory = _memory(proc.pid)
    print(f"oversized requests: {end - start:.2f} s; streams: {[len(a) for a in arrivals]} chunks, "
          f"{[round(a[-1] - end, 2) for a in arrivals]} s past them; memory {memory}, before {before}")
    for a in arrivals:
        assert a[-1] > end, "the stream ended before the oversized requests did"
        during = [b - a for a, b in zip(a, a[1:]) if b >= start and a <= end]
        assert max(during) < 1.0, max(during)
    assert memory["VmHWM"] - before < 200 * MiB, memory
    status, _ = http(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert status == 200  # still serving
