"""The engine loop: admit, prefill, run decode rounds, stop, free.

It is mode-agnostic: AR, SD and SSD differ only in the ``Decoder`` plugged in.
"""
from __future__ import annotations

import time

import torch

from saguaro.engine.decoder import Decoder
from saguaro.engine.detokenizer import IncrementalDetokenizer
from saguaro.engine.metrics import summarize
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.engine.outputs import RequestOutput, Timings
from saguaro.engine.prefill_chunks import prefill_chunks
from saguaro.engine.scheduler import Scheduler
from saguaro.engine.sequence import Sequence, Status
from saguaro.loading.tokenizer import Tokenizer
from saguaro.sampling.batch import sample_next
from saguaro.sampling.grammar import Grammars
from saguaro.sampling.logprobs import record_prompt_logprobs
from saguaro.sampling.params import SamplingParams


class RequestError(ValueError):
    """A request that can never be served (too long, bad parameters)."""


class LLMEngine:
    def __init__(self, target: ModelRunner, tokenizer: Tokenizer, decoder: Decoder,
                 max_model_len: int, max_num_seqs: int, max_prefill_tokens: int | str,
                 prefill_step_budget_s: float | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.max_model_len = max_model_len
        chunks = prefill_chunks(max_prefill_tokens, prefill_step_budget_s, target.device)
        self.scheduler = Scheduler(target.blocks, max_num_seqs, chunks, on_preempt=decoder.release)
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.grammars = Grammars(tokenizer, target.config.vocab_size)  # JSON-constrained requests' compiler
        # seconds spent in each kind of step, over the engine's life: a batch's decode rate is its new tokens over
        # its decode steps (wall time less the first token's mixes in the others' decoding between prefill chunks)
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}

    # -- requests -----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        self.check_request(prompt_ids, params)
        seq = Sequence(prompt_ids, params, prompt)
        if not params.ignore_eos:
            seq.end_ids += sorted(self.eos_ids)
        if params.grammar is not None:
            seq.grammar = self.grammars.state(params.grammar, seq.end_ids)
        self.scheduler.add(seq)
        return seq

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` for a request that can never be served."""
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len} "
                               "(the prompt must leave room for at least one generated token)")
        footprint = min(len(prompt_ids) + params.max_tokens, self.max_model_len) + self.decoder.lookahead
        capacity = self.target.blocks.num_blocks * self.target.block_size
        if footprint > capacity:
            raise RequestError(f"request needs up to {footprint} KV slots but the cache holds {capacity}; "
                               "raise kv_cache_tokens or lower max_tokens")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        outside = sorted(t for t in params.logit_bias if t >= vocab)
        if outside:
            raise RequestError(f"logit_bias token ids must lie in [0, {vocab}); got {outside[:5]}")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- one step -----------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Run one prefill chunk or decode round; return (sequence, tokens it gained).

        What goes wrong with one sequence's row after the batch's pass (a token it cannot take, a failing
        stop-string check) finishes that sequence alone with finish reason ``"error: ..."``; the others go on.
        """
        batch = self.scheduler.schedule(self.decoder.lookahead)
        if batch is None:
            return []
        start = time.perf_counter()
        new_tokens = self._prefill(batch.seqs, batch.chunks) if batch.is_prefill else self.decoder.decode(batch.seqs)
        events = []
        for seq, tokens in zip(batch.seqs, new_tokens):
            try:
                gained = self._append(seq, tokens)
            except Exception as e:  # this row only: the batch goes on
                gained = []
                seq.status, seq.finish_reason = Status.FINISHED, f"error: {type(e).__name__}: {e}"
            events.append((seq, gained))
            if seq.finished:
                self._finish(seq)
        self.step_seconds["prefill" if batch.is_prefill else "decode"] += time.perf_counter() - start
        return events

    def _prefill(self, seqs: list[Sequence], chunks: list[int]) -> list[list[int]]:
        """Feed each sequence its next ``chunks[i]`` prompt tokens; a fresh request whose prompt is then complete
        samples its first token from the last logits (one asking for ``max_tokens`` 0 ends there). A request with
        ``prompt_logprobs`` takes every row of its chunks, to score its prompt."""
        items, ends, samples = [], [], []
        for seq, n in zip(seqs, chunks):
            start, end = seq.num_cached, seq.num_cached + n
            sample = end == len(seq) and not seq.output_ids  # a resumed request re-feeds its last token next round
            scored = seq.params.prompt_logprobs is not None and not seq.output_ids
            items.append(ForwardItem(seq.tokens[start:end], start, seq.block_table,
                                     "all" if scored else "last" if sample else "none"))
            ends.append(end)
            samples.append(sample)
        with self.scheduler.chunks.timing([(n, seq.num_cached) for seq, n in zip(seqs, chunks)], self.target.device):
            self.decoder.prefilling(seqs, ends)  # the draft's chunk counts in the step's time
            logits = self.target.forward(items)
        for seq, item, rows in zip(seqs, items, logits):
            if item.logits == "all":
                record_prompt_logprobs(seq, item.start, rows)
        for seq, end in zip(seqs, ends):
            seq.num_cached = end
            if end == seq.prefill_end:
                self.scheduler.prefilled(seq)
        fresh = [(i, seq) for i, seq in enumerate(seqs) if samples[i]]
        for _, seq in fresh:
            if seq.params.max_tokens == 0:  # only the prompt's logprobs were asked for
                seq.status, seq.finish_reason = Status.FINISHED, "length"
        fresh = [(i, seq) for i, seq in fresh if not seq.finished]
        new_tokens: list[list[int]] = [[] for _ in seqs]
        if fresh:
            sampled = sample_next(torch.cat([logits[i][-1:] for i, _ in fresh]), [s for _, s in fresh])
            for (i, _), token in zip(fresh, sampled):
                new_tokens[i] = [token]
        return new_tokens

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping at EOS, a stop token or string, max_tokens or the context end.
        Raises ``ValueError`` for a token outside the vocabulary (a row the sampler could not sample)."""
        gained = []
        params = seq.params
        vocab = self.target.config.vocab_size
        pending, seq.pending_logprobs = seq.pending_logprobs, None
        for i, token in enumerate(tokens):
            if not 0 <= token < vocab:
                raise ValueError(f"sampling produced no valid token (got id {token}; the vocabulary is [0, {vocab}))"
                                 " - the logits of this request were not finite")
            if seq.grammar is not None:  # the matcher advances for real here; a refused token fails this request
                seq.grammar.advance(token)
            seq.output_ids.append(token)
            gained.append(token)
            if pending is not None:
                seq.output_logprobs.append(pending[i])
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
            if len(seq.output_ids) < params.min_tokens:  # nothing but the context's end stops it before
                seq.finish_reason = "length" if len(seq) >= self.max_model_len else None
                if params.stop:  # stop strings wholly inside the first min_tokens are passed over
                    self._stop_text(seq).push(seq.output_ids[len(seq.stop_text.ids):])
            elif (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif params.stop and self._hit_stop_string(seq):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                seq.status = Status.FINISHED
                break
        return gained

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Search only the new text (plus a stop string's length before it): linear in the output, not quadratic."""
        detok = self._stop_text(seq)
        before = len(detok.text)
        if not detok.push(seq.output_ids[len(detok.ids):]):
            return False
        begin = max(0, before - max(len(s) for s in seq.params.stop) + 1)
        cuts = [i for i in (detok.text.find(s, begin) for s in seq.params.stop if s) if i >= 0]
        if cuts:
            seq.stop_text_cut = min(cuts)
            return True
        return False

    def _stop_text(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.stop_text is None:
            seq.stop_text = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        return seq.stop_text

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.decoder.release(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if not seq.finished:
            seq.status = Status.FINISHED
            seq.finish_reason = reason
            self._finish(seq)

    # -- results ------------------------------------------------------------------
    def output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if seq.stop_text_cut is not None:
            text = text[:seq.stop_text_cut]
        end = seq.finish_time or time.perf_counter()
        first = seq.first_token_time or end
        n = len(seq.output_ids)
        timings = Timings(ttft_s=first - seq.arrival, total_s=end - seq.arrival,
                          decode_tokens_per_s=(n - 1) / (end - first) if n > 1 and end > first else 0.0)
        spec = summarize([seq.spec], self.decoder.reports_cache) if self.decoder.reports_spec else None
        return RequestOutput(seq.seq_id, seq.prompt, list(seq.prompt_ids), list(seq.output_ids), text,
                             seq.finish_reason or "length", timings, spec, seq.spec,
                             list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                             list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)

    def close(self) -> None:
        self.decoder.close()
