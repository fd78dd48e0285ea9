"""The public entry point: ``LLM(...).generate(prompts, params)``.

One class serves all three modes. AR decodes with the target alone; SD adds a draft
model (collocated), an EAGLE-3 head or the n-gram proposer; SSD runs the draft (a model or an EAGLE-3
head) in its own process or thread on its own device and answers each round from a speculation cache.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from typing import Any

from saguaro.build import build_decoder, resolve_draft, start_speculator_early
from saguaro.config import Config
from saguaro.cores import pin_process
from saguaro.engine.detokenizer import StreamText
from saguaro.engine.llm_engine import LLMEngine
from saguaro.engine.metrics import summarize
from saguaro.engine.outputs import RequestOutput, SpeculationMetrics, StreamChunk
from saguaro.loading import LoadedModel
from saguaro.loading.dtype import checkpoint_dtype
from saguaro.sampling.params import SamplingParams
from saguaro.target import build_target

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, *, target: str | LoadedModel | None = None,
                 draft: str | LoadedModel | None = None, **options: Any):
        target = target if target is not None else model
        if target is None:
            raise ValueError("LLM needs a model: LLM('qwen2.5-coder-1.5b') or LLM(target=..., draft=...)")
        self.config = cfg = _config(target, draft, options)
        if cfg.device == "cpu":
            pin_process(cfg.target_cores, cfg.threads)
        early = start_speculator_early(cfg, target, draft)  # SSD on the CPU: its draft loads beside the target
        try:
            self._target = build_target(target, cfg)  # ranks other than 0 under torchrun serve in here, then exit
        except BaseException:
            if early is not None:
                early.link.kill()
            raise
        self.target, self.tokenizer = self._target.loaded, self._target.loaded.tokenizer
        self.max_model_len = self._target.max_model_len
        try:
            self.draft = resolve_draft(draft, cfg, self._target)  # one kind: none, n-gram, a model, an EAGLE-3 head
            decoder = build_decoder(cfg, self._target, self.draft, early)
        except BaseException:
            if early is not None:
                early.link.kill()
            self._target.close()  # no tensor-parallel rank is left waiting
            raise
        self.engine = LLMEngine(self._target.runner, self.tokenizer, decoder, self.max_model_len, cfg.max_num_seqs,
                                cfg.max_prefill_tokens, cfg.prefill_step_budget_s)

    # -- generation ----------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        return list(prompt), None

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs keep prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _params_for(params, len(prompts))
        seqs = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids, text = self._encode(prompt)
                seqs.append(self.engine.add_request(ids, p, text))
        except Exception:
            for seq in seqs:
                self.engine.abort(seq)
            raise
        pending = set(s.seq_id for s in seqs)
        while pending:
            for seq, _ in self.engine.step():
                if seq.finished:
                    pending.discard(seq.seq_id)
        return [self.engine.output(s) for s in seqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield tokens of one request as rounds produce them."""
        ids, text = self._encode(prompt)
        seq = self.engine.add_request(ids, params or SamplingParams(), text)
        # decodes only the new tokens of each chunk
        shown = StreamText(self.tokenizer, seq.params.stop, seq.params.skip_special_tokens)
        try:
            while not seq.finished:
                for s, tokens in self.engine.step():
                    if s is not seq or not tokens:
                        continue
                    final = self.engine.output(seq) if seq.finished else None
                    delta = shown.delta(tokens, final.text if final else None)
                    yield StreamChunk(seq.seq_id, tokens, delta, seq.finished, seq.finish_reason, final)
        finally:
            self.engine.abort(seq)

    def spec_metrics(self, outputs: list[RequestOutput]) -> SpeculationMetrics | None:
        """Speculation metrics summed over the given outputs' requests."""
        if not self.engine.decoder.reports_spec:
            return None
        return summarize([o.spec_counts for o in outputs], self.engine.decoder.reports_cache)

    def close(self) -> None:
        self.engine.close()
        self._target.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config(target: str | LoadedModel, draft: str | LoadedModel | None, options: dict[str, Any]) -> Config:
    """The validated Config, with "auto" dtype and K resolved."""
    if options.get("dtype", "auto") == "auto":  # the checkpoint's own dtype; a model in memory keeps its own
        options["dtype"] = checkpoint_dtype(target)
    cfg = Config(target=_name(target), draft=_name(draft) if draft is not None else None, **options)
    if cfg.num_speculative_tokens == "auto":  # calibration code is imported only for "auto" settings
        from saguaro.calibration.resolve import resolve_k
        cfg = resolve_k(cfg)
    return cfg


def _name(model: str | LoadedModel) -> str:
    return model if isinstance(model, str) else model.name


def _params_for(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
