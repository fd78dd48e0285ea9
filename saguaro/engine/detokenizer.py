"""Text of a growing token list, decoding only what is new.

Decoding the whole output on every chunk costs O(n) per chunk, O(n^2) per request. Here each
step decodes a short window instead:

  ids:   [ ... done ... | prefix | unread ]
                        ^        ^
                 prefix_offset  read_offset

``decode(prefix + unread)`` minus ``decode(prefix)`` is the new text. The prefix (the tokens of
the previous step) gives the decoder its context, so tokenizers that treat a leading token
specially (SentencePiece's leading space) decode the new tokens as they would in place.

Multi-byte characters: byte-level BPE splits one UTF-8 character (an emoji, most CJK) over
several tokens. A window that ends inside such a character decodes to U+FFFD; we then emit
nothing and keep the tokens unread until the character is complete. ``finish`` emits whatever is
left, so the concatenated pieces equal ``tokenizer.decode(ids)``.
"""
from __future__ import annotations

from collections.abc import Sequence

from saguaro.loading.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # leave special tokens (chat markers, EOS) out
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly "" while a character is split)."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Emit what is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        window = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if not final and (window.endswith(_INCOMPLETE) or len(window) <= len(prefix)):
            return ""
        new = window[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new


class StreamText:
    """What a stream may show of a request's text so far.

    Until the request finishes, the last ``max(len(stop)) - 1`` characters are held back: a stop
    string may still begin there, and the engine cuts the text where it begins. (Any stop string
    that begins earlier is already complete, so the engine has finished the request.)
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.shown = 0

    def delta(self, new_ids: Sequence[int], final_text: str | None = None) -> str:
        """New text to show after ``new_ids``; pass the request's final (stop-cut) text once it finished."""
        self.detokenizer.push(new_ids)
        if final_text is not None:
            piece, self.shown = final_text[self.shown:], len(final_text)
            return piece
        visible = len(self.detokenizer.text) - self.holdback
        if visible <= self.shown:
            return ""
        piece, self.shown = self.detokenizer.text[self.shown:visible], visible
        return piece
