"""Fill-in-the-middle: ``suffix`` on /v1/completions and llama.cpp's /infill, greedy-equal in AR, SD and SSD.

A tiny random model whose tokenizer has the three FIM markers as special tokens (ids read from the
tokenizer, as the server does); the same model without them gets a clear 400. The real
Qwen2.5-Coder 0.5B completes an obvious middle (``slow``).
"""
import json

import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine

from saguaro import LLM, SamplingParams  # noqa: E402
from saguaro.loading import MODELS, installed, load_model  # noqa: E402
from saguaro.loading.tokenizer import Tokenizer, numbered_tokenizer  # noqa: E402
from saguaro.server.fim import MARKERS, FimTokens, NoFillInTheMiddle, fim_prompt  # noqa: E402
from tests.serving import http, running_server  # noqa: E402
from tests.tiny import tiny_model, truncated  # noqa: E402

VOCAB = 64
PREFIX, SUFFIX = "t1 t2 t3", "t9 t8"


def fim_tokenizer() -> Tokenizer:
    """Words t0 .. t60, then the markers as special tokens at 61, 62, 63."""
    tok = numbered_tokenizer(VOCAB - len(MARKERS))
    tok.backend.add_special_tokens(list(MARKERS))
    return tok


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=3, vocab=VOCAB, layers=3, sharpness=3.0)
    target.tokenizer = fim_tokenizer()
    draft = truncated(target, 1)
    return target, draft


def engines(pair):
    target, draft = pair
    yield "ar", LLM(target, block_size=4)
    yield "sd", LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=3, block_size=4)
    yield "ssd", LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=3, fan_out=[2, 2, 2, 4],
                     block_size=4, worker_timeout_s=60)


def test_prompt_layout_reads_the_markers_from_the_tokenizer(pair):
    tok = pair[0].tokenizer
    fim = FimTokens.of(tok)
    assert (fim.prefix, fim.suffix, fim.middle) == (61, 62, 63) and fim.file_sep is None
    assert fim_prompt(tok, PREFIX, SUFFIX) == [61, 1, 2, 3, 62, 9, 8, 63]
    assert fim_prompt(tok, "t1", "", [("a.py", "t4 t5")], after_middle="t7") == [4, 5, 61, 1, 62, 63, 7]
    with pytest.raises(NoFillInTheMiddle, match="<|fim_prefix|>"):
        FimTokens.of(numbered_tokenizer(VOCAB))


def test_fim_is_greedy_equal_in_every_mode_and_route(pair):
    """The engine on the FIM prompt, /v1/completions with suffix and /infill: one middle, in AR, SD and SSD."""
    ids = fim_prompt(pair[0].tokenizer, PREFIX, SUFFIX)
    texts = {}
    for mode, llm in engines(pair):
        stops = list(FimTokens.of(pair[0].tokenizer).stops)
        engine_text = llm.generate([ids], SamplingParams(max_tokens=10, stop_token_ids=stops))[0].text
        with running_server(llm) as s:
            client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
            out = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=10, temperature=0)
            status, raw = http(s.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 10,
                                                   "temperature": 0})
            assert status == 200, raw
            infill = json.loads(raw)
            stream = list(client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=10,
                                                    temperature=0, stream=True))
        assert out.choices[0].text == engine_text == infill["content"], mode
        assert "".join(c.choices[0].text for c in stream) == engine_text
        assert infill["stop"] is True and infill["tokens_evaluated"] == len(ids)
        assert infill["stop_type"] == {"stop": "eos", "length": "limit"}[out.choices[0].finish_reason]
        texts[mode] = engine_text
    assert texts["ar"] == texts["sd"] == texts["ssd"] and texts["ar"]


def test_infill_streams_in_llama_cpp_shape(pair):
    with running_server(LLM(pair[0], block_size=4)) as s:
        status, raw = http(s.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6,
                                               "temperature": 0, "stream": True})
        whole = json.loads(http(s.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6,
                                                    "temperature": 0})[1])
    events = [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]


def test_model_without_fim_tokens_gets_a_400(pair):
    plain = tiny_model(seed=3, vocab=VOCAB)
    with running_server(LLM(plain, block_size=4)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="cannot fill in the middle"):
            client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
        status, raw = http(s.url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX})
        assert status == 400 and "cannot fill in the middle" in json.loads(raw)["error"]["message"]
        assert client.completions.create(model="tiny", prompt=PREFIX, max_tokens=2).usage.completion_tokens == 2
    with running_server(LLM(pair[0], block_size=4)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="token ids"):
            client.completions.create(model="tiny", prompt=[1, 2], suffix=SUFFIX, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="echo and suffix"):
            client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=4)


@pytest.mark.slow
@pytest.mark.skipif(not installed(MODELS["qwen2.5-coder-0.5b"]), reason=MODELS["qwen2.5-coder-0.5b"].pip_command)
def test_qwen_coder_fills_an_obvious_middle():
    loaded = load_model("qwen2.5-coder-0.5b", progress=False)
    with running_server(LLM(loaded, max_model_len=512)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)
        prefix = "def add(a, b):\n    return"
        suffix = "\n\n\nprint(add(2, 3))  # prints 5\n"
        middle = client.completions.create(model="tiny", prompt=prefix, suffix=suffix, max_tokens=12,
                                           temperature=0).choices[0].text
        status, raw = http(s.url + "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 12,
                                               "temperature": 0})
    assert middle.strip().replace(" ", "") == "a+b", middle
    assert status == 200 and json.loads(raw)["content"] == middle
