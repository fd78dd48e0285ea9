"""The cheap refusals of oversized requests, piece by piece: the character bound never exceeds a text's real
token count (so no prompt that fits is refused) on real and built tokenizers, and refuses nothing on tokenizers it
cannot bound; the body limit answers 413 before reading a declared-too-long body and stops reading a chunked one;
the default limit follows the context. The served end to end: tests/test_server_oversized.py."""
import asyncio
import random
import sys
import threading
import time

import pytest

pytest.importorskip("uvicorn")  # the server's packages: absent on the GPU machine

from tokenizers import models, normalizers, pre_tokenizers  # noqa: E402

from saguaro.loading import MODELS, installed, load_tokenizer  # noqa: E402
from saguaro.loading.tokenizer import Tokenizer  # noqa: E402
from saguaro.server.lifecycle import ServerLimits  # noqa: E402
from saguaro.server.request_limits import (_WHITESPACE, BASE_REQUEST_BYTES, BodyLimit, CharacterBound,  # noqa: E402
                                           byte_symbols, default_max_request_bytes)
from tests.tiny import BPE_CORPUS, byte_level_bpe, tiny_tokenizer, trained_tokenizer  # noqa: E402

BUILT = {
    "byte-level": byte_level_bpe,
    "byte-level+NFC": lambda: trained_tokenizer(models.BPE(), normalizers.NFC(), pre_tokenizers.ByteLevel(), True),
    "whitespace-split, unk per character": lambda: trained_tokenizer(
        models.BPE(unk_token="[UNK]"), None, pre_tokenizers.WhitespaceSplit(), special_tokens=["[UNK]"]),
    "metaspace+NFKC, byte fallback": lambda: trained_tokenizer(
        models.BPE(byte_fallback=True), normalizers.NFKC(), pre_tokenizers.Metaspace(),
        special_tokens=[f"<0x{b:02X}>" for b in range(256)]),
}


def texts(seed: int, n: int = 60) -> list[str]:
    """Texts that stress the bound: long runs of one character, whitespace runs, combining marks, emoji."""
    rng = random.Random(seed)
    pieces = ["a", "aaaa", " ", "    ", "\t", "\n", "é", "e\u0301", "\u1100\u1161\u11a8", "🌵", "日本", "x", "=",
              "\u00a0", "\u3000", "def ", "return", "ω\u0313\u0300\u0345", "\x13\x14\x16"] + BPE_CORPUS
    return [("".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))) for _ in range(n)] + [
        "a" * 5000, " " * 5000, "=" * 3000, "e\u0301" * 2000, "\u1100\u1161\u11a8" * 1000, "\x13" * 5000]


def _check_sound(tok: Tokenizer, seed: int) -> int:
    bound = CharacterBound.of(tok)
    assert bound.span is not None
    tight = 0
    for text in texts(seed):
        n = len(tok.encode(text, add_special_tokens=False))
        assert bound.fewest_tokens(text) <= n, (text[:40], bound, n)
        tight = max(tight, bound.fewest_tokens(text))
    return tight


@pytest.mark.parametrize("name", list(BUILT))
def test_bound_never_exceeds_the_token_count(name):
    assert _check_sound(BUILT[name](), seed=len(name)) > 0  # and it is not vacuous


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_bound_on_real_tokenizers(model):
    if not installed(MODELS[model]):
        pytest.skip(f"{model} is not installed")
    tok = load_tokenizer(model, progress=False)
    bound = CharacterBound.of(tok)
    assert bound.span is not None and " " not in bound.uncounted
    _check_sound(tok, seed=7)
    # what refuses the 10 MB prompt of a 32k context: a fraction of a second, no tokens
    assert bound.fewest_tokens("x" * 10_000_000) > 32_768


def test_no_bound_where_a_token_may_stand_for_any_run():
    """A word-level model maps a whole unknown word to one token: it gets no bound, and so refuses nothing."""
    word_level = tiny_tokenizer(64)
    assert CharacterBound.of(word_level).span is None
    assert CharacterBound.of(word_level).fewest_tokens("x" * 10**6) == 0
    assert len(word_level.encode("x" * 10**6)) == 1  # why: one unknown word, one token
    removing = byte_level_bpe()
    removing.backend.normalizer = normalizers.Replace(" ", "")
    assert CharacterBound.of(removing).span is None


def test_dropped_characters_are_not_counted():
    """A byte-level vocabulary without some byte's symbol drops that character (SmolLM2 drops a few control
    characters): the bound counts them as nothing."""
    tok = byte_level_bpe()
    assert set(byte_symbols().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert CharacterBound.of(tok).uncounted == ""
    vocab = tok.vocab()
    kept = {t: i for t, i in vocab.items() if t != byte_symbols()[0x13]}
    tok.backend.model = models.BPE(kept, [], unk_token=None)
    assert tok.encode("\x13" * 1000) == []
    bound = CharacterBound.of(tok)
    assert bound.uncounted == "\x13" and bound.fewest_tokens("\x13" * 1000) == 0


def test_whitespace_dropped_is_not_counted():
    tok = BUILT["whitespace-split, unk per character"]()
    bound = CharacterBound.of(tok)
    assert set(_WHITESPACE) <= set(bound.uncounted)
    assert bound.fewest_tokens(" " * 100_000 + "a") == 1 == len(tok.encode(" " * 100_000 + "a"))
    assert set(_WHITESPACE) >= {chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()}


def test_check_says_why():
    tok = byte_level_bpe()
    bound = CharacterBound.of(tok)
    bound.check("hello", 16)
    with pytest.raises(ValueError, match="maximum context length is 16 tokens.*at least"):
        bound.check("a" * (16 * bound.span), 16)


def test_default_body_limit_follows_the_context():
    assert default_max_request_bytes(8192) == BASE_REQUEST_BYTES + 96 * 8192
    assert default_max_request_bytes(131072) > default_max_request_bytes(8192)
    with pytest.raises(ValueError, match="max_request_bytes"):
        ServerLimits(max_request_bytes=0)


async def _call(headers: list, chunks: list[bytes]) -> tuple[int, int, bool]:
    """Run the middleware over a body sent in ``chunks``; (status, chunks the client had to send, app reached)."""
    sent, statuses, reached = 0, [], []

    async def receive():
        nonlocal sent
        sent += 1
        return {"type": "http.request", "body": chunks[sent - 1], "more_body": sent < len(chunks)}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def app(scope, receive, send):
        reached.append(True)
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    from starlette.responses import Response
    await BodyLimit(app, 1000, lambda: Response(status_code=413))(
        {"type": "http", "method": "POST", "headers": headers}, receive, send)
    return statuses[0], sent, bool(reached)


def test_body_limit_reads_no_further():
    assert asyncio.run(_call([(b"content-length", b"50000000")], [b"x" * 100] * 10)) == (413, 0, False)  # no byte read
    assert asyncio.run(_call([], [b"x" * 300] * 100)) == (413, 4, True)  # chunked: stopped once past the limit
    assert asyncio.run(_call([(b"content-length", b"900")], [b"x" * 300] * 3)) == (200, 3, True)


def test_tokenizing_lets_other_threads_run():
    """A long prompt is tokenized off the event loop, and other threads (the loop, the engine) run meanwhile: a
    ticker keeps ticking through it. (Word-level: no character bound, so the whole text is tokenized.)"""
    from saguaro.server.prompt_encoder import PromptEncoder
    encoder = PromptEncoder(tiny_tokenizer(64), context_tokens=10**9)
    text = "t1 t22 t3 " * 60_000
    ticks, done = [time.monotonic()], threading.Event()

    def ticker():
        while not done.is_set():
            time.sleep(0.005)
            ticks.append(time.monotonic())
    thread = threading.Thread(target=ticker)
    thread.start()
    start = time.monotonic()
    ids = asyncio.run(encoder.encode(text))
    took = time.monotonic() - start
    done.set()
    thread.join()
    encoder.close()
    assert ids == tiny_tokenizer(64).encode(text) and took > 0.1  # long enough to see a stall
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if b > start]
    assert max(gaps) < took / 2, (max(gaps), took)  # the GIL-holding call would stall it for all of ``took``
