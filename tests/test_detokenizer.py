"""Incremental detokenization: each chunk decodes a short window, multi-byte characters split over tokens
come out whole, and the pieces add up to the full decode; streams hold back what a stop string may cut."""
import pytest

from saguaro import LLM, SamplingParams
from saguaro.engine.detokenizer import IncrementalDetokenizer, StreamText
from saguaro.loading import MODELS, installed, load_tokenizer
from tests.tiny import PROMPTS, tiny_model

TEXT = ("Hello 世界! 🌵 saguaro 🤖🎉 naïve café — 日本語テキスト 👨‍👩‍👧 ok\n"
        "  def f(x): return '✓'")


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def tokenizer(request):
    if not installed(MODELS[request.param]):
        pytest.skip(f"{request.param} is not installed")
    return load_tokenizer(request.param, progress=False)


class CountingTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def decode(self, ids, skip_special_tokens=False):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_pieces_are_whole_characters_and_add_up(tokenizer, step):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the text does split characters over tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT == detok.text


@pytest.mark.parametrize("step", [1, 3])
def test_decoding_work_is_linear_in_the_output(tokenizer, step):
    """Re-decoding everything per chunk would decode ~n^2 / (2 step) ids; a window decodes a few per token
    (measured: 3.5-5.5 ids per token on these tokenizers, the window growing only across split characters)."""
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    for i in range(0, len(ids), step):
        detok.push(ids[i:i + step])
    detok.finish()
    assert detok.text == TEXT * 20
    assert sum(counting.sizes) <= 8 * len(ids)


def test_a_truncated_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("ok 🌵", add_special_tokens=False)
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    shown = detok.push(ids[:cut])
    assert "\ufffd" not in shown
    assert shown + detok.finish() == tokenizer.decode(ids[:cut])


def test_stream_text_never_shows_what_a_stop_string_cuts(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "テキスト"
    cut = TEXT.index(stop)
    stream = StreamText(tokenizer, [stop, "zz"])
    shown = ""
    for i, token in enumerate(ids):
        so_far = tokenizer.decode(ids[:i + 1])
        finished = stop in so_far
        shown += stream.delta([token], so_far[:cut] if finished else None)
        assert TEXT[:cut].startswith(shown)
        if finished:
            break
    assert shown == TEXT[:cut]


def test_llm_stream_equals_generate_with_stop_strings():
    loaded = tiny_model(seed=1)
    with LLM(loaded, block_size=4) as llm:
        free_run = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12))[0]
        word = loaded.tokenizer.decode(free_run.token_ids[5:7])
        params = SamplingParams(max_tokens=12, stop=[word, "t999 t998"])
        full = llm.generate([PROMPTS[0]], params)[0]
        chunks = list(llm.stream(PROMPTS[0], params))
    assert full.finish_reason == "stop" and word not in full.text
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].output.text == full.text
