"""Prompt text to token ids, off the event loop and off the engine's thread.

The event loop serves every client's stream and the engine thread runs the steps: neither tokenizes.
A prompt is rendered (chat template) and tokenized on a pool of worker threads, with the tokenizer's
call that releases the GIL, so a long prompt delays no other request's tokens. A prompt whose length
alone proves that it cannot fit the context is refused before it is tokenized (the character bound,
``saguaro.server.request_limits``).
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from saguaro.loading.tokenizer import Tokenizer
from saguaro.server.request_limits import CharacterBound

WORKERS = 2  # prompts tokenized at once


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, context_tokens: int, workers: int = WORKERS):
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.bound = CharacterBound.of(tokenizer)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="saguaro-tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``ValueError`` for a text that cannot fit the context (then it is not tokenized)."""
        return await self.off_loop(self._encode, text, add_special_tokens)

    async def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                          ) -> str:
        """The prompt text of a chat (``Tokenizer.apply_chat_template``, with the generation prompt and the tools,
        if any)."""
        extra = {} if tools is None else {"tools": tools}
        return await self.off_loop(functools.partial(self.tokenizer.apply_chat_template, **extra), messages, True)

    def check_length(self, text: str) -> None:
        """``ValueError`` for a text whose length alone proves it cannot fit the context."""
        self.bound.check(text, self.context_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.check_length(text)
        return self.tokenizer.encode_nogil(text, add_special_tokens)

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the pool (other text work: a fill-in-the-middle prompt's pieces)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
