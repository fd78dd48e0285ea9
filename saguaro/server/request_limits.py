"""What an oversized request may cost the server: next to nothing.

Glossary:
  body limit       a request body over ``max_request_bytes`` gets a 413 and is not read further: a declared
                   ``Content-Length`` over the limit before any of the body is read, a body sent without one
                   (chunked) as soon as the bytes received pass the limit. uvicorn stops reading a socket
                   whose body the app does not take, so the rest never reaches memory.
  default limit    derived from the context: ``BASE_REQUEST_BYTES`` for the JSON around the prompt plus
                   ``BYTES_PER_CONTEXT_TOKEN`` per token of context (a token is rarely over 16 characters,
                   and a character at most 6 bytes of JSON, ``\\uXXXX``).
  character bound  a prompt is refused before it is tokenized when its length in characters proves that it
                   cannot fit the context: no token stands for more than ``span`` characters of the text
                   (the longest string in the vocabulary, added tokens included), so a text of ``c`` kept
                   characters is at least ``c / span`` tokens. "Kept": a tokenizer that drops whitespace
                   (whitespace-splitting pre-tokenizers, ``Strip``, added tokens that absorb the spaces
                   beside them) is held to its non-whitespace characters only; a normalizer that composes
                   characters (NFC, NFKC) may join up to 4 into one, so ``span`` is 4 times longer there;
                   a byte-level vocabulary without the symbol of some one-byte character (SmolLM2's lacks
                   a few control characters) drops that character, which is not counted either.
                   Tokenizers with a part that may drop or merge characters without bound (a model that
                   maps a whole unknown word to one token, regex replacements, accent stripping, an
                   unknown part) get no bound: their prompts are tokenized, off the event loop, and
                   checked after.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from saguaro.loading.tokenizer import Tokenizer

BASE_REQUEST_BYTES = 1 << 20  # messages, settings, JSON around the prompt
BYTES_PER_CONTEXT_TOKEN = 96


def default_max_request_bytes(context_tokens: int) -> int:
    """The default body limit of a server whose context holds ``context_tokens``."""
    return BASE_REQUEST_BYTES + BYTES_PER_CONTEXT_TOKEN * context_tokens


class _TooLarge(Exception):
    """The body passed the limit while it was being received."""


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets ``on_too_large()`` (a 413) and is not read further."""

    def __init__(self, app, max_bytes: int, on_too_large: Callable[[], Any]):
        self.app, self.max_bytes, self.on_too_large = app, max_bytes, on_too_large

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)  # before a byte of the body is read
            return
        received, started = 0, False

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        """The 413, with ``Connection: close``: else the server would read (and drop) the rest of the body to keep
        the connection."""
        async def closing(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)
        await self.on_too_large()(scope, receive, closing)


# Characters a tokenizer may drop as whitespace: Unicode White_Space (Rust's ``char::is_whitespace``, the
# regex ``\s``), Python's ``isspace`` and the zero-width ones; counting too many is safe (a looser bound).
_WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
               "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\u180e\u200b\u200c\u200d\u2060\ufeff")
_DROP_WHITESPACE = {"WhitespaceSplit", "Whitespace", "BertPreTokenizer", "Strip"}
_KEEP = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "NFD", "NFKD", "Lowercase",
         "Prepend", "Sequence"}
_COMPOSE = {"NFC", "NFKC"}  # canonical composition joins at most 4 code points (U+1FAF's decomposition)
_KNOWN = _KEEP | _COMPOSE | _DROP_WHITESPACE | {"Split", "Replace"}


@dataclass(frozen=True)
class CharacterBound:
    """A lower bound on a text's token count from its length alone. ``span``: the most characters of the text
    one token stands for (``None``: no bound); ``uncounted``: characters the tokenizer may drop."""
    span: int | None
    uncounted: str = ""

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> CharacterBound:
        spec = json.loads(tokenizer.backend.to_str())
        parts = [*_parts(spec.get("normalizer")), *_parts(spec.get("pre_tokenizer"))]
        added = spec.get("added_tokens", [])
        dropped = _dropped_by_model(spec["model"], parts, tokenizer.vocab())
        if (dropped is None or spec.get("truncation") is not None
                or any(p["type"] not in _KNOWN or _drops_matches(p) for p in parts)):
            return cls(None)
        if any(p["type"] in _DROP_WHITESPACE for p in parts) or any(a.get("lstrip") or a.get("rstrip")
                                                                   for a in added):
            dropped += _WHITESPACE
        shrink = 4 if any(p["type"] in _COMPOSE for p in parts) else 1
        longest = max([len(t) for t in tokenizer.vocab()] + [len(a["content"]) for a in added])
        ratio = max([_replace_ratio(p) for p in parts if p["type"] == "Replace"], default=1)
        return cls(longest * shrink * ratio, "".join(sorted(set(dropped))))

    def fewest_tokens(self, text: str) -> int:
        """At most the number of tokens ``text`` encodes to (0 when there is no bound)."""
        if self.span is None:
            return 0
        kept = len(text)
        if self.uncounted and kept > self.span:  # (a short text fits anyway: no need to count)
            kept -= sum(text.count(c) for c in self.uncounted)
        return -(-kept // self.span)

    def check(self, text: str, context_tokens: int) -> None:
        """Raise ``ValueError`` when ``text`` cannot fit a context of ``context_tokens`` (with one token to spare
        for the answer)."""
        fewest = self.fewest_tokens(text)
        if fewest >= context_tokens:
            raise ValueError(f"This model's maximum context length is {context_tokens} tokens. However, your "
                             f"prompt has at least {fewest} tokens ({len(text)} characters, no token of this "
                             f"model spans more than {self.span}). Please reduce the length of the prompt.")


def _parts(spec: dict | None) -> list[dict]:
    """A normalizer's or pre-tokenizer's parts, sequences flattened."""
    if spec is None:
        return []
    inner = spec.get("normalizers") or spec.get("pretokenizers")
    return [spec] if inner is None else [p for s in inner for p in _parts(s)]


def _drops_matches(part: dict) -> bool:
    """A split that removes what it matches, or a replacement by nothing or of a pattern: text may vanish."""
    if part["type"] == "Split":
        return part.get("behavior") == "Removed"
    if part["type"] == "Replace":
        return "String" not in part["pattern"] or not part["content"]
    return False


def _replace_ratio(part: dict) -> int:
    """How many characters of the text a replaced character may stand for."""
    return -(-len(part["pattern"]["String"]) // len(part["content"]))


def byte_symbols() -> dict[int, str]:
    """Byte-level BPE's symbol for each byte (GPT-2's table: printable bytes stand for themselves)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _dropped_by_model(model: dict, parts: list[dict], vocab: dict[str, int]) -> str | None:
    """The characters the model drops, when every other character ends up in some token of bounded length
    (``None`` otherwise): byte-level input (a one-byte character whose symbol is missing is dropped), byte
    fallback, or an unknown token for each unknown character (not one for a run of them)."""
    if model["type"] not in ("BPE", "Unigram"):
        return None  # WordLevel and WordPiece map a whole unknown word to one token
    if any(p["type"] == "ByteLevel" for p in parts):
        missing = [b for b, symbol in byte_symbols().items() if symbol not in vocab]
        if any(0x80 <= b < 0xC0 for b in missing):
            return None  # a multi-byte character with no symbol for any of its bytes could vanish
        return "".join(chr(b) for b in missing if b < 0x80)  # (0xC0, 0xC1, 0xF5-0xFF never occur in UTF-8)
    if model.get("byte_fallback"):
        return "" if all(f"<0x{b:02X}>" in vocab for b in range(256)) else None
    return "" if model["type"] == "BPE" and model.get("unk_token") is not None and not model.get("fuse_unk") else None
