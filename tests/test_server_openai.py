"""The server against the official ``openai`` client: completions and chat, streaming or not, stop, seed,
max_tokens, temperature, top_p, include_usage, n, logit processors, refused logprobs, the model name, the API key,
/metrics."""
import pytest

openai = pytest.importorskip("openai")  # the server's packages: absent on the GPU machine
text_string_to_metric_families = pytest.importorskip("prometheus_client.parser").text_string_to_metric_families

from saguaro import LLM, SamplingParams  # noqa: E402
from tests.serving import chat_model, http, running_server  # noqa: E402

PROMPT = "t1 t2 t3"
MESSAGES = [{"role": "system", "content": "t7"}, {"role": "user", "content": "t4 t5"}]


@pytest.fixture(scope="module")
def served():
    with running_server(LLM(chat_model(), block_size=4, max_model_len=64)) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    with LLM(chat_model(), block_size=4, max_model_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60)


def ref_text(reference, prompt, **params) -> str:
    return reference.generate([prompt], SamplingParams(**params))[0].text


def chat_prompt(reference) -> list[int]:
    tok = reference.tokenizer
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).model == "tiny"
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)


def test_completion_greedy_equals_the_engine(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0)
    assert out.choices[0].text == ref_text(reference, PROMPT, max_tokens=9)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 9 and out.usage.prompt_tokens == 3 and out.usage.total_tokens == 12


def test_completion_stream_equals_non_stream(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_chat_and_chat_stream(client, reference):
    expected = reference.generate([chat_prompt(reference)], SamplingParams(max_tokens=7))[0].text
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    stream = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=7,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_strings(client, reference):
    free = reference.generate([PROMPT], SamplingParams(max_tokens=12))[0]
    stop = reference.tokenizer.decode(free.token_ids[6:8])
    expected = free.text[:free.text.index(stop)]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "t99"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_temperature_top_p(client, reference):
    def sample(**kw):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, **kw).choices[0].text
    a = sample(temperature=1.0, seed=7)
    assert a == sample(temperature=1.0, seed=7) == ref_text(reference, PROMPT, max_tokens=10, temperature=1.0, seed=7)
    assert sample(temperature=0.5, top_p=0.9, seed=3) == ref_text(reference, PROMPT, max_tokens=10, temperature=0.5,
                                                                  top_p=0.9, seed=3)
    # top_p this small keeps only the likeliest token: greedy
    assert sample(temperature=1.0, top_p=1e-9, seed=1) == ref_text(reference, PROMPT, max_tokens=10)
    assert len({sample(temperature=1.5, seed=s) for s in range(6)}) > 1


def test_include_usage(client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 3 and all(c.usage is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 4


def test_n_choices(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:  # choice i samples with seed + i
        assert c.text == ref_text(reference, PROMPT, max_tokens=8, temperature=1.0, seed=5 + c.index)
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == 3
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0,
                                                seed=2, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, seed=2, n=2)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 128"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=129)


def test_several_prompts(client, reference):
    out = client.completions.create(model="tiny", prompt=["t1 t2", "t8"], max_tokens=4, temperature=0)
    assert [c.text for c in out.choices] == [ref_text(reference, p, max_tokens=4) for p in ["t1 t2", "t8"]]
    out = client.completions.create(model="tiny", prompt=[[5, 6, 7], [1]], max_tokens=4, temperature=0, n=2)
    expected = [ref_text(reference, p, max_tokens=4) for p in [[5, 6, 7], [5, 6, 7], [1], [1]]]
    assert [c.text for c in out.choices] == expected and out.usage.prompt_tokens == 4


def _text(reference, token: int) -> str:
    return reference.tokenizer.decode([token], skip_special_tokens=False)


def test_completion_logprobs_equal_the_engine(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    expected = reference.generate([PROMPT], SamplingParams(max_tokens=6, logprobs=3))[0]
    lp = out.choices[0].logprobs
    assert lp.tokens == [_text(reference, t) for t in expected.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert [list(top) for top in lp.top_logprobs] == [[_text(reference, t) for t, _ in e.top]
                                                      for e in expected.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                              stream=True))
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed), []) == lp.token_logprobs


def test_echo_scores_the_prompt(client, reference):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs."""
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ids = reference.tokenizer.encode(PROMPT)
    expected = reference.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [_text(reference, t) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-5)
    both = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0)
    assert both.choices[0].text == PROMPT + ref_text(reference, PROMPT, max_tokens=3)
    assert both.choices[0].logprobs.token_logprobs[:len(ids)] == choice.logprobs.token_logprobs
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 3


def test_chat_logprobs(client, reference):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)
    expected = reference.generate([chat_prompt(reference)], SamplingParams(max_tokens=5, logprobs=2))[0]
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [_text(reference, t) for t in expected.token_ids]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and bytes(c.bytes).decode() == c.token for c in content)
    streamed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True)
    entries = [e for chunk in streamed for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.logprob for e in entries] == [c.logprob for c in content]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=False)
    assert plain.choices[0].logprobs is None


def test_logit_processors_equal_the_engine(client, reference):
    """Penalties, logit_bias and vLLM's repetition_penalty / min_tokens / ignore_eos reach the engine as given."""
    settings = dict(frequency_penalty=0.8, presence_penalty=-0.5, logit_bias={"5": 3.0, "12": -100.0})
    extra = dict(repetition_penalty=1.4, min_tokens=6, ignore_eos=True)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, extra_body=extra,
                                    **settings)
    expected = ref_text(reference, PROMPT, max_tokens=10, frequency_penalty=0.8, presence_penalty=-0.5,
                        logit_bias={5: 3.0, 12: -100.0}, **extra)
    assert out.choices[0].text == expected != ref_text(reference, PROMPT, max_tokens=10)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body=extra, **settings)
    assert chat.choices[0].message.content == reference.generate([chat_prompt(reference)], SamplingParams(
        max_tokens=6, frequency_penalty=0.8, presence_penalty=-0.5, logit_bias={5: 3.0, 12: -100.0}, **extra))[0].text


@pytest.mark.parametrize("fields, message", [
    (dict(logit_bias={"64": 1.0}), r"logit_bias token ids must lie in \[0, 64\)"),
    (dict(logit_bias={"t5": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={"5": 101.0}), "logit_bias values must lie in"),
    (dict(presence_penalty=2.5), "presence_penalty: Input should be less than or equal to 2"),
    (dict(frequency_penalty=-3), "frequency_penalty: Input should be greater than or equal to -2"),
    (dict(extra_body=dict(repetition_penalty=0)), "repetition_penalty: Input should be greater than 0"),
    (dict(extra_body=dict(min_tokens=5)), "min_tokens must be an integer in"),
])
def test_bad_processor_settings_get_a_400(client, fields, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **fields)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    status, text = http(url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_count(served, client):
    before = metric_values(served.url)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    after = metric_values(served.url)

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert grew("saguaro:generation_tokens_total") == out.usage.completion_tokens == 6
    assert grew("saguaro:prompt_tokens_total") == 3
    assert grew("saguaro:request_success_total", (("finished_reason", "length"),)) == 1
    assert grew("saguaro:time_to_first_token_seconds_count") == 1
    assert grew("saguaro:time_per_output_token_seconds_count") == 1
    assert after[("saguaro:num_requests_running", ())] == 0
    assert after[("saguaro:num_requests_waiting", ())] == 0
    assert after[("saguaro:kv_cache_usage_perc", ())] == 0


def test_api_key():
    with running_server(LLM(chat_model(), block_size=4, max_model_len=64), api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0).models.list()
        assert http(s.base_url + "/completions", {"prompt": "t1"})[0] == 401
        good = openai.OpenAI(base_url=s.base_url, api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert http(s.url + "/health")[0] == 200  # health and metrics stay open
        assert http(s.url + "/metrics")[0] == 200
