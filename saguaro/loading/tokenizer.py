"""Tokenizer: a ``tokenizers.Tokenizer`` plus special ids and the chat template.

We keep transformers out of the serving path: the fast tokenizer JSON does the work, and
chat templates are rendered with jinja2 the same way transformers renders them (sandboxed
environment, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, a non-escaping
``tojson``, ``bos_token``/``eos_token`` variables), so prompts match token for token.

Speculative decoding needs draft and target to share a vocabulary: a draft token id must
mean the same string to the target. ``check_shared_vocabulary`` compares the token→id maps
(not the embedding row counts: a model's embedding may be padded past the tokenizer), as dicts: hashing
them (``vocab_fingerprint``) serializes 150k tokens, 1.4 s a tokenizer on a loaded 2-core machine.
``file_sha256`` lets a caller skip even parsing a second tokenizer whose file has the same bytes
(``saguaro.loading.check_draft_vocabulary``: a draft of the target's family).
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class VocabularyMismatchError(ValueError):
    """Two tokenizers map tokens to ids differently, so their ids cannot be exchanged."""


class ChatTemplateError(ValueError):
    """No chat template is available, or rendering it failed."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes, which would change the prompt text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks; we just render it."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    def __init__(self, backend: _HFTokenizer, eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, chat_template: str | None = None, file_sha256: str | None = None):
        self.backend = backend
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.file_sha256 = file_sha256  # of the tokenizer.json it was read from (None: built in memory)

    def __getstate__(self) -> dict:
        # the compiled chat template holds jinja's environment, which does not pickle (a draft shipped to the
        # speculator's process carries its tokenizer): it is compiled again on first use there
        state = dict(self.__dict__)
        state.pop("_template", None)
        return state

    @classmethod
    def from_file(cls, path: Path | str, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None,
                  chat_template: str | None = None) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        data = path.read_bytes()
        return cls(_HFTokenizer.from_str(data.decode()), eos_token_ids, bos_token_id, chat_template,
                   hashlib.sha256(data).hexdigest())

    # --- basic coding ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_nogil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` that lets other Python threads run meanwhile: the backend's batch call releases the GIL, its
        single call holds it (for seconds on a long text)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added/special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special_ids(self) -> list[int]:
        """Ids of the added/special tokens (chat markers, EOS, padding) and of every EOS token."""
        return sorted(set(self.backend.get_added_tokens_decoder()) | set(self.eos_token_ids))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    # --- vocabulary identity -----------------------------------------------------------
    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @cached_property
    def _fingerprint(self) -> str:
        items = sorted(self.vocab().items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()

    def vocab_fingerprint(self) -> str:
        """sha256 over the (token, id) pairs: equal fingerprints ⇔ interchangeable ids."""
        return self._fingerprint

    # --- chat --------------------------------------------------------------------------
    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass a raw prompt instead")
        try:
            return _environment().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{"role", "content"}, …]) into the prompt string the model expects.

        Extra keyword arguments (``tools``, ``documents``, …) become template variables.
        """
        variables = {"messages": list(messages), "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        # the template already writes any BOS it wants, so no post-processor specials here
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def numbered_tokenizer(vocab: int, eos: int | None = None) -> Tokenizer:
    """A word-level tokenizer over the words "t0" .. "t{vocab-1}": for random-weight models of any vocabulary
    (tests, and benchmarks on random weights of real shapes), which have no tokenizer of their own."""
    from tokenizers.decoders import WordPiece
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    backend = _HFTokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, [eos] if eos is not None else [])


def check_shared_vocabulary(a: Tokenizer, b: Tokenizer, names: tuple[str, str] = ("draft", "target")) -> None:
    """Raise VocabularyMismatchError unless ``a`` and ``b`` map every token to the same id."""
    va, vb = a.vocab(), b.vocab()
    if va == vb:
        return
    only_a = sorted(set(va) - set(vb), key=va.__getitem__)
    only_b = sorted(set(vb) - set(va), key=vb.__getitem__)
    moved = sorted((t for t in set(va) & set(vb) if va[t] != vb[t]), key=va.__getitem__)
    parts = [f"{names[0]} has {len(va)} tokens, {names[1]} has {len(vb)}"]
    if only_a:
        parts.append(f"{len(only_a)} only in {names[0]} (e.g. {only_a[:3]!r})")
    if only_b:
        parts.append(f"{len(only_b)} only in {names[1]} (e.g. {only_b[:3]!r})")
    if moved:
        t = moved[0]
        parts.append(f"{len(moved)} with different ids (e.g. {t!r}: {va[t]} vs {vb[t]})")
    raise VocabularyMismatchError(
        "the two models do not share a vocabulary, so draft tokens cannot be verified by the target: "
        + "; ".join(parts))
