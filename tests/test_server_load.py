"""A bounded load test on loopback: 32 concurrent streaming clients (the official openai client), mixed greedy
and sampled, in AR, SD and SSD mode, on tiny random models with a KV cache small enough to preempt.

Every request completes with its max_tokens; greedy outputs equal the same request run alone with AR (every
mode is lossless); in AR mode the seeded sampled ones do too (each request has its own generator); no KV block
leaks. In SSD mode the speculator is killed midway: every stream still completes, exactly, and the server
keeps answering. The speculation metrics add up.
"""
import random
import threading

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
text_string_to_metric_families = pytest.importorskip("prometheus_client.parser").text_string_to_metric_families

from saguaro import LLM, SamplingParams  # noqa: E402
from tests.serving import http, running_server  # noqa: E402

CLIENTS = 32
K = 3


def requests() -> list[dict]:
    rng = random.Random(0)
    out = []
    for i in range(CLIENTS):
        request = {"prompt": [rng.randrange(64) for _ in range(rng.randint(1, 8))], "max_tokens": rng.randint(12, 24)}
        request.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": i})
        out.append(request)
    return out


@pytest.fixture(scope="module")
def alone(pair):
    """Each request run by itself with AR."""
    with LLM(pair[0], block_size=4) as llm:
        return [llm.generate([r["prompt"]], SamplingParams(
            max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r.get("top_p", 1.0),
            seed=r.get("seed")))[0].text for r in requests()]


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = http(url + "/metrics")[1]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def hold_until_all_submitted(engine) -> None:
    """The engine's first step waits (up to 30 s) until every client's request is in: the 32 then run together and
    the tight cache must preempt, however fast the first requests would have finished alone."""
    submitted, all_in = [0], threading.Event()
    submit, step = engine.submit, engine.llm.engine.step

    def counting_submit(*args, **kwargs):
        request_id = submit(*args, **kwargs)
        submitted[0] += 1
        if submitted[0] >= CLIENTS:
            all_in.set()
        return request_id

    def held_step():
        all_in.wait(30)
        return step()

    engine.submit, engine.llm.engine.step = counting_submit, held_step


@pytest.mark.parametrize("mode", ["ar", "sd", pytest.param("ssd", marks=pytest.mark.worker_failure)])
def test_32_streaming_clients(pair, alone, mode):
    options = {} if mode == "ar" else dict(draft=pair[1], mode=mode, num_speculative_tokens=K,
                                           adaptive=False)  # fixed K: the spec metrics below count drafts
    llm = LLM(pair[0], block_size=4, kv_cache_tokens=256, max_num_seqs=16, **options)
    with running_server(llm) as served:
        client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)
        results: list[dict | None] = [None] * CLIENTS
        lock = threading.Lock()
        progress = {"chunks": 0, "finished": 0, "killed_with_unfinished": None}

        def kill_speculator() -> None:
            link = served.engine.llm.engine.decoder.link
            if link is not None:
                link.process.kill()
                progress["killed_with_unfinished"] = CLIENTS - progress["finished"]

        def client_run(i: int, request: dict) -> None:
            text, finish, usage = "", None, None
            for chunk in client.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                                   **request):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
                with lock:
                    progress["chunks"] += 1
                    if mode == "ssd" and progress["chunks"] == 60:  # midway: kill the speculator
                        kill_speculator()
            with lock:
                progress["finished"] += 1
            results[i] = {"text": text, "finish": finish, "tokens": usage.completion_tokens}

        hold_until_all_submitted(served.engine)
        threads = [threading.Thread(target=client_run, args=(i, r)) for i, r in enumerate(requests())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client hung"

        for i, (request, result) in enumerate(zip(requests(), results)):
            assert result is not None, f"client {i} got no complete stream"
            assert result["finish"] == "length" and result["tokens"] == request["max_tokens"]
            if request["temperature"] == 0 or mode == "ar":
                assert result["text"] == alone[i], (mode, i)
        assert served.idle(), "KV blocks leaked"
        assert served.engine.llm.engine.scheduler.num_preemptions > 0  # the cache was tight enough to preempt
        decoder = served.engine.llm.engine.decoder
        if mode == "sd":
            draft_blocks = decoder.proposer.runner.blocks
            assert draft_blocks.num_free == draft_blocks.num_blocks, "draft KV blocks leaked"
        if mode == "ssd":
            assert progress["killed_with_unfinished"] and decoder.failure is not None
        # the server keeps answering (request 0 again, greedy: its first 12 tokens are those it had alone)
        again = client.completions.create(model="tiny", prompt=requests()[0]["prompt"], max_tokens=12, temperature=0)
        assert alone[0].startswith(again.choices[0].text) and again.usage.completion_tokens == 12

        m = samples(served.url)
        total = sum(r["max_tokens"] for r in requests())
        assert m[("saguaro:generation_tokens_total", ())] == total + 12
        assert m[("saguaro:request_success_total", (("finished_reason", "length"),))] == CLIENTS + 1
        if mode != "ar":
            by_pos = [m.get(("saguaro:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)), 0)
                      for i in range(K)]
            drafted = [m.get(("saguaro:spec_decode_num_draft_tokens_per_pos_total", (("position", str(i)),)), 0)
                       for i in range(K)]
            assert sum(by_pos) == m[("saguaro:spec_decode_num_accepted_tokens_total", ())] > 0
            assert sum(drafted) == m[("saguaro:spec_decode_num_draft_tokens_total", ())] >= sum(by_pos)
            assert all(a <= d for a, d in zip(by_pos, drafted))
        if mode == "ssd":
            hits, misses = m[("saguaro:ssd_cache_hits_total", ())], m[("saguaro:ssd_cache_misses_total", ())]
            assert hits > 0 and hits + misses == m[("saguaro:spec_decode_num_drafts_total", ())]
