"""Fill-in-the-middle prompts: a prefix and a suffix, completed with the middle between them.

Code models trained for it (Qwen2.5-Coder, StarCoder, CodeLlama's successors) read them as
``<|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>`` and write the middle next. The three
markers are special tokens of the model's tokenizer; their ids are read from it, never assumed.
Context from other files (llama.cpp's ``input_extra``) goes first, each file after ``<|file_sep|>``
and its name when the tokenizer has that token (Qwen2.5-Coder's repository format), as plain text
otherwise. The text pieces are encoded on their own and joined with the markers' ids, so text that
merely looks like a marker is never read as one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from saguaro.loading.tokenizer import Tokenizer

MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
FILE_SEP = "<|file_sep|>"
NEVER_IN_A_MIDDLE = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", *MARKERS)  # they end a middle


class NoFillInTheMiddle(ValueError):
    """The model's tokenizer has no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None
    stops: tuple[int, ...]  # markers that end a middle when the model writes one

    @staticmethod
    def of(tokenizer: Tokenizer) -> "FimTokens":
        """The tokenizer's markers; raises ``NoFillInTheMiddle`` naming the missing ones."""
        ids = [tokenizer.token_to_id(m) for m in MARKERS]
        missing = [m for m, i in zip(MARKERS, ids) if i is None]
        if missing:
            raise NoFillInTheMiddle(f"this model cannot fill in the middle: its tokenizer has no {', '.join(missing)} "
                                    "token (suffix and /infill need a model trained for it, such as Qwen2.5-Coder)")
        stops = tuple(i for i in (tokenizer.token_to_id(t) for t in NEVER_IN_A_MIDDLE) if i is not None)
        return FimTokens(ids[0], ids[1], ids[2], tokenizer.token_to_id(FILE_SEP), stops)


def fim_prompt(tokenizer: Tokenizer, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
               after_middle: str = "") -> list[int]:
    """Token ids of a fill-in-the-middle prompt.

    Args:
        prefix, suffix: the text before and after the middle.
        extra: (file name, text) of other files, put first as context.
        after_middle: text the middle starts with (llama.cpp's ``prompt``).
    """
    fim = FimTokens.of(tokenizer)

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False) if s else []
    ids: list[int] = []
    for name, body in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep] + text(f"{name}\n{body}" if name else body)
        else:
            ids += text(body)
    return ids + [fim.prefix] + text(prefix) + [fim.suffix] + text(suffix) + [fim.middle] + text(after_middle)
