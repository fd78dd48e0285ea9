"""Logprobs in OpenAI's two shapes: the completions API's parallel lists, and chat's list of token objects.

A token's text is its own decoding (special tokens included); chat adds its UTF-8 bytes, which is what
lets a client rebuild characters that byte-level BPE splits over tokens.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any

from saguaro.loading.tokenizer import Tokenizer
from saguaro.sampling.logprobs import TokenLogprob


def _text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, output: list[TokenLogprob], first_prompt_token: int | None = None,
                        prompt: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``: with ``prompt`` (echo), the prompt's
    entries first, its first token (``first_prompt_token``, which nothing predicts) with None; then the output's."""
    entries: list[tuple[int, float | None, dict[str, float] | None]] = []
    if prompt is not None:
        entries.append((first_prompt_token, None, None))
        prompt = [e for e in prompt[1:] if e is not None]
    for e in list(prompt or []) + list(output):
        entries.append((e.token, e.logprob, {_text(tokenizer, t): v for t, v in e.top}))
    tokens = [_text(tokenizer, t) for t, _, _ in entries]
    offsets = list(accumulate((len(x) for x in tokens[:-1]), initial=0))[:len(tokens)]
    return {"tokens": tokens, "token_logprobs": [v for _, v, _ in entries],
            "top_logprobs": [top for _, _, top in entries], "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, output: list[TokenLogprob]) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    def item(token: int, value: float) -> dict[str, Any]:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in output]}
