"""JSON-constrained decoding with xgrammar: a grammar mask on the target's distribution.

A constrained request samples from the target's distribution with every token the grammar forbids
after the prefix removed (logit -inf), then renormalized. Speculative decoding stays exact the way
it does for the other logit processors (``saguaro.sampling.logit_processors``): row ``j`` of a
verification pass is masked by the grammar state after the output *and* the drafts ``d_1 .. d_j``,
so it is the mask plain decoding would use there whenever the round keeps that prefix. A draft the
grammar forbids has probability 0 under the row before it, so the ordinary rejection rule refuses
it whatever the draft proposed; the rows after it are never read. The matcher walks the drafts and
rolls back; it advances for real only through the tokens the sequence has actually appended.

xgrammar was chosen by measuring one token's mask on the CPU (a few microseconds; llguidance was
slower). Compiled grammars are cached by the compiler, so a schema is compiled once per server.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from saguaro.engine.sequence import Sequence
    from saguaro.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class JsonGrammar:
    """What a request's output must be: JSON that validates against ``schema`` (a JSON Schema, as JSON text),
    or any JSON object when ``schema`` is None."""
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.schema is not None:
            try:
                parsed = json.loads(self.schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"a JSON schema is an object (or true/false), got {type(parsed).__name__}")


class Grammars:
    """The grammar compiler for one tokenizer and vocabulary (the target's logits width); built on first use,
    since indexing a large vocabulary takes seconds."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()  # the server compiles on a worker thread, the engine on its own

    def _compiler_once(self) -> Any:
        with self._lock:
            return self._compiler if self._compiler is not None else self._build()

    def _build(self) -> Any:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        # the stop tokens are each matcher's own (its request's end ids); these only silence a warning
        stop = list(self.tokenizer.eos_token_ids) or [self.vocab_size - 1]
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=stop)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, grammar: JsonGrammar) -> Any:
        """The compiled grammar; raises ``ValueError`` naming the problem when xgrammar refuses the schema."""
        compiler = self._compiler_once()
        try:
            # compact JSON (no free whitespace): a model cannot pad the output with blanks until max_tokens
            compiled = compiler.compile_json_schema(grammar.schema or '{"type": "object"}', any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError (and others) for schemas it cannot compile
            raise ValueError(f"the JSON schema cannot be compiled: {e}") from None
        if not _can_start(compiled, self.vocab_size):
            raise ValueError("this model's vocabulary has no token that can start the requested JSON")
        return compiled

    def state(self, grammar: JsonGrammar, end_ids: list[int]) -> "GrammarState":
        """A fresh matcher for one sequence; it may end only on ``end_ids`` (EOS and the request's stop ids)."""
        import xgrammar as xgr
        if not end_ids:
            raise ValueError("a constrained request needs an end token (EOS or stop_token_ids) to finish on")
        return GrammarState(xgr.GrammarMatcher(self.compile(grammar), override_stop_tokens=list(end_ids)))


def _can_start(compiled: Any, vocab_size: int) -> bool:
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool((bitmask != 0).any())


class GrammarState:
    """One sequence's matcher; ``accepted`` counts the output tokens it has advanced through for real."""

    def __init__(self, matcher: Any):
        self.matcher, self.accepted = matcher, 0

    def advance(self, token: int) -> None:
        """Take an appended token; ``ValueError`` when the grammar refuses it (a state no token of this
        vocabulary continues, whose row was all -inf), which fails this request alone."""
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} breaks the request's grammar: the grammar has no continuation in "
                             "this model's vocabulary")
        self.accepted += 1

    def fill(self, bitmask: torch.Tensor, first: int, drafts: list[int], n_rows: int) -> None:
        """Rows ``first .. first + n_rows - 1`` of ``bitmask``: row ``j`` after the drafts ``d_1 .. d_j``. A row
        past a draft the grammar refuses (or past the end) is never read; it repeats the last real mask."""
        m, walked = self.matcher, 0
        for j in range(n_rows):
            if j > 0 and (m.is_terminated() or not m.accept_token(drafts[j - 1])):
                bitmask[first + j:first + n_rows] = bitmask[first + j - 1]
                break
            walked += j > 0
            if m.is_terminated():
                bitmask[first + j:first + n_rows] = bitmask[first + j - 1] if j else bitmask[first + j]
                break
            m.fill_next_token_bitmask(bitmask, first + j)
        if walked:
            m.rollback(walked)


def apply_grammar_masks(logits: torch.Tensor, seqs: list["Sequence"], rows: list[int],
                        drafts: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [R, V] float32 with each constrained sequence's rows masked (see the module docstring); the
    input itself when no sequence has a grammar. ``rows`` and ``drafts`` as ``apply_logit_processors``. Float32
    logits are masked in place: a pass's logits are read by its sampling alone, and a copy of a large
    vocabulary's rows would cost more than the masks."""
    if not any(getattr(s, "grammar", None) is not None for s in seqs):
        return logits
    import xgrammar as xgr
    out = logits.float()
    bitmask = xgr.allocate_token_bitmask(len(out), out.shape[-1])  # all allowed (-1) until filled
    host_drafts = drafts.cpu().tolist() if drafts is not None else None
    first = 0
    for b, (seq, n) in enumerate(zip(seqs, rows)):
        if seq.grammar is not None:
            seq.grammar.fill(bitmask, first, host_drafts[b] if host_drafts is not None else [], n)
        first += n
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=out.shape[-1])
    return out
