"""The public entry point: ``LLM(...).generate(prompts, params)``.

One class serves all three modes. AR decodes with the target alone; SD adds a draft
model (collocated), an EAGLE-3 head or the n-gram proposer; SSD runs the draft (a model or an EAGLE-3
head) in its own process or thread on its own device and answers each round from a speculation cache.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence as Seq
from typing import Any

from saguaro.config import Config
from saguaro.engine.decoder import ARDecoder, Decoder
from saguaro.engine.detokenizer import StreamText
from saguaro.device import load_or_place, pin_process
from saguaro.engine.llm_engine import LLMEngine
from saguaro.engine.metrics import summarize
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.outputs import RequestOutput, SpeculationMetrics, StreamChunk
from saguaro.loading import LoadedModel
from saguaro.loading.dtype import checkpoint_dtype
from saguaro.loading.tokenizer import check_shared_vocabulary
from saguaro.sampling.params import SamplingParams

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
        self._eagle = _eagle_head_dir(cfg, draft)  # an EAGLE-3 head drafts from the target's features
        self._tp = None
        if cfg.tensor_parallel_size > 1:  # ranks other than 0 under torchrun serve in here, then exit
            from saguaro.parallel.launch import RankOptions, TensorParallelTarget
            self._tp = TensorParallelTarget(target, RankOptions.from_config(cfg, _num_blocks(cfg)))
        self.target = self._tp.loaded if self._tp else _load(target, cfg, dtype=cfg.target_torch_dtype)
        self.tokenizer = self.target.tokenizer
        self.draft = (_load(draft, cfg, cfg.draft_device or cfg.device, cfg.draft_torch_dtype)
                      if draft is not None and cfg.mode != "ar" and self._eagle is None else None)
        if self.draft is not None:
            check_shared_vocabulary(self.target.tokenizer, self.draft.tokenizer)
        # a speculator process loads a named draft itself (mapping the same cached file) rather than receiving a copy
        by_name = isinstance(draft, str) and cfg.speculator_transport == "process"
        self._draft_source = draft if by_name else self.draft
        self.max_model_len = min(cfg.max_model_len or self.target.config.max_position_embeddings,
                                 self.target.config.max_position_embeddings)
        runner = self._target_runner()
        self.engine = LLMEngine(runner, self.tokenizer, self._decoder(runner, runner.blocks.num_blocks),
                                self.max_model_len, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.prefill_step_budget_s)

    def _target_runner(self) -> ModelRunner:
        """Rank 0's runner of a tensor-parallel target (its blocks: the fewest any rank holds), or the target's
        own, with its graphs captured before any speculator starts (one capture at a time)."""
        if self._tp:
            return self._tp.runner
        cfg = self.config
        runner = ModelRunner(self.target.model, _num_blocks(cfg), cfg.block_size, cfg.device,
                             enforce_eager=cfg.enforce_eager, weights=cfg.target_weights,
                             max_seq_len=self.max_model_len)
        runner.capture_graphs(cfg.graph_rows, taps=self._eagle_taps())
        return runner

    def _eagle_taps(self) -> tuple[int, ...]:
        """The target layers an EAGLE-3 head reads (its graphs copy their inputs out), or none."""
        if self._eagle is None:
            return ()
        from saguaro.eagle.checkpoint import load_eagle3_config
        return tuple(load_eagle3_config(self._eagle).layers_for(self.target.config.num_layers))

    def _decoder(self, runner: ModelRunner, num_blocks: int) -> Decoder:
        cfg = self.config
        if cfg.mode == "ar":
            return ARDecoder(runner)
        if self._eagle is not None and cfg.mode == "sd":
            from saguaro.eagle.proposer import build_eagle_decoder
            return build_eagle_decoder(cfg, runner, self._eagle, num_blocks, self.max_model_len)
        if cfg.mode == "sd":
            from saguaro.sd.sd import build_sd_decoder
            return build_sd_decoder(cfg, runner, self.draft, num_blocks, self.max_model_len)
        from saguaro.calibration.resolve import ssd_plan
        from saguaro.ssd.ssd_decoder import build_ssd_decoder
        plan = ssd_plan(cfg, runner.config.vocab_size)
        draft = self._draft_source
        if self._eagle is not None:  # the head, and what it reads of the target (shared, not copied, by a thread)
            from saguaro.eagle.runner import EagleDraft
            draft = EagleDraft(self._eagle, runner.config, runner.model.model.embed_tokens.weight)
        return build_ssd_decoder(cfg, plan, runner, draft, self.max_model_len)

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
        if self._tp:
            self._tp.close()

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


def _num_blocks(cfg: Config) -> int:
    return math.ceil(cfg.kv_cache_tokens / cfg.block_size)


def _name(model: str | LoadedModel) -> str:
    return model if isinstance(model, str) else model.name


def _eagle_head_dir(cfg: Config, draft: str | LoadedModel | None) -> str | None:
    """The EAGLE-3 head directory that drafts, if the draft is one (``draft_kind``)."""
    if cfg.mode == "ar" or cfg.proposer != "draft" or cfg.draft_kind == "model" or not isinstance(draft, str):
        if cfg.draft_kind == "eagle3" and not isinstance(draft, str):
            raise ValueError("draft_kind='eagle3' needs the head's directory as draft=")
        return None
    from saguaro.eagle.checkpoint import is_eagle3_dir
    if cfg.draft_kind == "eagle3" or is_eagle3_dir(draft):
        cfg.check_eagle3(f"the EAGLE-3 head {draft}")
        if cfg.tensor_parallel_size > 1:
            raise ValueError("an EAGLE-3 draft reads the target's whole hidden states, which no tensor-parallel "
                             "rank holds: use tensor_parallel_size=1 or a draft model")
        return draft
    return None


def _load(model: str | LoadedModel, cfg: Config, device: str | None = None, dtype: Any = None) -> LoadedModel:
    return load_or_place(model, device or cfg.device, dtype or cfg.torch_dtype)


def _params_for(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
