"""transformers as a reference peer: plain ``generate`` and ``generate(assistant_model=draft)``.

The HF models are built from our converted cache (``load_model(name).weights_dir``), which
holds a config.json in our ``ModelConfig`` format and safetensors with HF parameter names:
we write a transformers ``Qwen2Config`` from the ``ModelConfig`` fields next to a link to the
weights and call ``from_pretrained`` on that directory, in bf16.

Timing matches the engine's ``decode_tokens_per_s``: a streamer stamps every chunk of new
tokens; decode tok/s is the tokens after the first chunk over the time after it. (Plain
decoding streams one token per chunk. Assisted decoding streams each round's accepted
tokens, and its first chunk also carries the prefill, so that whole chunk is left out.)
Tokens per round is new tokens over target forward calls (counted with a forward hook).
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Prompt, Record, log
from saguaro.cores import pin_process


def qwen2_config(cfg: Any) -> Any:
    """A transformers ``Qwen2Config`` from our ``ModelConfig``."""
    import transformers
    if cfg.arch != "qwen2":
        raise ValueError(f"the transformers baseline builds Qwen2 models only, got {cfg.arch!r}")
    if cfg.hidden_size // cfg.num_heads != cfg.head_dim:
        raise ValueError("Qwen2Config derives head_dim from hidden_size / num_heads; this model differs")
    return transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids), pad_token_id=cfg.bos_token_id)


def load_hf(name: str) -> Any:
    """Qwen2ForCausalLM in bf16 from the converted cache of registry model ``name``."""
    import transformers
    from saguaro.loading import load_model
    transformers.logging.set_verbosity_error()  # generate() warns about config/kwargs mixing on every call
    loaded = load_model(name, dtype=torch.bfloat16, progress=False)  # also makes sure the bf16 file exists
    weights_dir, cfg = Path(loaded.weights_dir), loaded.config
    del loaded
    gc.collect()
    weights = weights_dir / "model.bfloat16.safetensors"
    if not weights.exists():
        weights = weights_dir / "model.safetensors"
    tmp = Path(tempfile.mkdtemp(prefix="saguaro-hf-"))
    try:
        qwen2_config(cfg).save_pretrained(tmp)
        (tmp / "model.safetensors").symlink_to(weights)
        model = transformers.Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.eval()


class _Clock:
    """A transformers streamer that only stamps the time and size of each chunk."""

    def __init__(self):
        self.chunks: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass


class HFRunner:
    def __init__(self, target: str, draft: str | None, threads: int = 1, cores: list[int] | None = None):
        pin_process(cores or [0], threads)
        self.threads = threads
        log(f"transformers: loading {target}" + (f" and {draft}" if draft else ""))
        self.target = load_hf(target)
        self.draft = load_hf(draft) if draft else None
        self.eos = list(self.target.config.eos_token_id)
        self.forwards = 0
        self.target.register_forward_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.forwards += 1

    @torch.inference_mode()
    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int,
                 assistant_k: int | None | str = None) -> tuple[list[int], float, float, int]:
        """(new token ids, decode tok/s, ttft s, target forward calls) for one request.

        ``assistant_k``: None for plain decoding; an int for the draft with a constant K and
        no confidence cut-off; "default" for transformers' own assisted settings.
        """
        kwargs: dict[str, Any] = dict(max_new_tokens=max_tokens, eos_token_id=self.eos,
                                      pad_token_id=self.target.config.pad_token_id)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        if assistant_k is not None:
            if self.draft is None:
                raise ValueError("assisted generation needs a draft model")
            kwargs["assistant_model"] = self.draft
            gc_ = self.draft.generation_config
            if assistant_k == "default":
                gc_.num_assistant_tokens = gc_.num_assistant_tokens_schedule = None
                gc_.assistant_confidence_threshold = None
            else:
                gc_.num_assistant_tokens = int(assistant_k)
                gc_.num_assistant_tokens_schedule = "constant"
                gc_.assistant_confidence_threshold = 0.0  # falsy: no early stop of the draft
        clock = _Clock()
        input_ids = torch.tensor([ids])
        self.forwards = 0
        start = time.perf_counter()
        out = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=clock, **kwargs)
        end = time.perf_counter()
        new = out[0, len(ids):].tolist()
        gen_chunks = clock.chunks[1:]  # the first put is the prompt
        ttft = gen_chunks[0][0] - start if gen_chunks else end - start
        after = len(new) - (gen_chunks[0][1] if gen_chunks else len(new))
        last = gen_chunks[-1][0] if gen_chunks else end
        tok_s = after / (last - gen_chunks[0][0]) if after > 0 and gen_chunks and last > gen_chunks[0][0] else 0.0
        return new, tok_s, ttft, self.forwards

    def run(self, config: str, prompts: list[Prompt], temperatures: list[float], max_tokens: int, seed: int,
            assistant_k: int | None | str = None, warmup_tokens: int = 4) -> list[Record]:
        if warmup_tokens > 0:
            self.generate(prompts[0].ids, warmup_tokens, 0.0, seed, assistant_k)
        records = []
        for temperature in temperatures:
            for p in prompts:
                t0 = time.perf_counter()
                new, tok_s, ttft, forwards = self.generate(p.ids, max_tokens, temperature, seed + p.index, assistant_k)
                total = time.perf_counter() - t0
                finish = "stop" if new and new[-1] in self.eos else "length"
                records.append(Record(config, p.dataset, p.index, temperature, tok_s, ttft, total, len(new), finish,
                                      new, extra={} if assistant_k is None else {"target_forwards": forwards}))
                log(f"  {config} | {p.dataset}[{p.index}] T={temperature:g}: {len(new)} tokens, {tok_s:.2f} tok/s, "
                    f"{len(new) / max(forwards, 1):.2f} tokens per target forward")
        return records

    def close(self) -> None:
        self.target = self.draft = None
        gc.collect()
