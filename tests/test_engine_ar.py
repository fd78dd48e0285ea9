"""AR engine: continuous batching equals running alone; blocks come back; bad input is refused."""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.engine.llm_engine import RequestError
from tests.tiny import tiny_model


def greedy_reference(loaded, prompt, n):
    """Plain full-recompute greedy decoding with our model: no cache reuse, no batching."""
    from saguaro.kv.kv_cache import KVCache
    from saguaro.kv.metadata import build_metadata
    ids = list(prompt)
    for _ in range(n):
        cache = KVCache(loaded.config, 64, 16, torch.float32)
        meta = build_metadata([list(range(len(ids)))], [len(ids)])
        with torch.no_grad():
            h = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, meta)
            ids.append(int(loaded.model.logits(h[-1:]).argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1)


PROMPTS = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7], [3, 3, 3, 3, 8, 40, 2, 11, 60, 1, 5]]


def test_batched_greedy_equals_alone_and_reference(target):
    llm = LLM(target, block_size=4, kv_cache_tokens=512)
    params = SamplingParams(max_tokens=12)
    together = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        assert out.token_ids == greedy_reference(target, prompt, 12)
        assert out.finish_reason == "length"
    assert llm.engine.target.blocks.num_free == llm.engine.target.blocks.num_blocks


def test_the_engine_counts_its_prefill_and_decode_steps_seconds(target, monkeypatch):
    """``step_seconds``: each step's time under its kind (a batch's decode rate reads the decode steps'), here
    on a clock that each prefill step advances by 1 s and each decode step by 0.01 s."""
    import saguaro.engine.llm_engine as engine_module
    llm = LLM(target, block_size=4, kv_cache_tokens=512, max_prefill_tokens=4)
    engine, now, kinds = llm.engine, [0.0], []

    class Clock:
        @staticmethod
        def perf_counter():
            return now[0]
    real_prefill, real_decode = engine._prefill, engine.decoder.decode

    def prefill(seqs, chunks):
        now[0] += 1.0
        kinds.append("prefill")
        return real_prefill(seqs, chunks)

    def decode(seqs):
        now[0] += 0.01
        kinds.append("decode")
        return real_decode(seqs)
    monkeypatch.setattr(engine_module, "time", Clock)
    monkeypatch.setattr(engine, "_prefill", prefill)
    monkeypatch.setattr(engine.decoder, "decode", decode)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6))
    # prompts of 3, 7, 1 and 11 tokens in chunks of at most 4 interleave with the others' decode rounds
    assert kinds.count("prefill") >= 6 and kinds.index("decode") < len(kinds) - kinds[::-1].index("prefill")
    assert engine.step_seconds == pytest.approx({"prefill": kinds.count("prefill"),
                                                 "decode": 0.01 * kinds.count("decode")})


def test_request_joining_mid_flight(target):
    llm = LLM(target, block_size=4, kv_cache_tokens=512)
    engine = llm.engine
    params = SamplingParams(max_tokens=10)
    first = engine.add_request(PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    late = engine.add_request(PROMPTS[3], params)
    while engine.has_unfinished:
        engine.step()
    assert first.output_ids == greedy_reference(target, PROMPTS[1], 10)
    assert late.output_ids == greedy_reference(target, PROMPTS[3], 10)
    assert engine.target.blocks.num_free == engine.target.blocks.num_blocks


def test_preemption_when_blocks_run_out(target):
    # 10 blocks of 4 tokens cannot hold four requests of ~20 tokens at once
    llm = LLM(target, block_size=4, kv_cache_tokens=40)
    params = SamplingParams(max_tokens=14)
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target, prompt, 14)
    assert llm.engine.target.blocks.num_free == llm.engine.target.blocks.num_blocks


def test_seeded_sampling_independent_of_batch(target):
    llm = LLM(target, block_size=4, kv_cache_tokens=512)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=123, max_tokens=10)
    other = SamplingParams(temperature=0.7, seed=7, max_tokens=5)
    alone = llm.generate([PROMPTS[0]], p)[0].token_ids
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [other, p, SamplingParams(max_tokens=3)])
    assert mixed[1].token_ids == alone


def test_stop_on_eos_and_stop_string():
    loaded = tiny_model(seed=1)
    llm = LLM(loaded, block_size=4, kv_cache_tokens=512)
    free_run = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12))[0]
    eos = free_run.token_ids[5]
    loaded.tokenizer.eos_token_ids = [eos]
    llm2 = LLM(loaded, block_size=4, kv_cache_tokens=512)
    out = llm2.generate([PROMPTS[0]], SamplingParams(max_tokens=12))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[:free_run.token_ids.index(eos) + 1]
    word = loaded.tokenizer.decode([free_run.token_ids[3]])
    out = LLM(tiny_model(seed=1), block_size=4).generate([PROMPTS[0]], SamplingParams(max_tokens=12, stop=[word]))[0]
    assert out.finish_reason == "stop" and word not in out.text


def test_streaming_yields_the_same_tokens(target):
    llm = LLM(target, block_size=4)
    params = SamplingParams(max_tokens=8)
    chunks = list(llm.stream(PROMPTS[1], params))
    assert [t for c in chunks for t in c.token_ids] == llm.generate([PROMPTS[1]], params)[0].token_ids
    assert chunks[-1].finished and chunks[-1].output is not None


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_refused_and_others_continue(target):
    llm = LLM(target, block_size=4, max_model_len=32)
    with pytest.raises(RequestError, match="context"):
        llm.generate([list(range(1, 40))], SamplingParams(max_tokens=4))
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == greedy_reference(target, PROMPTS[0], 4)
    assert llm.engine.target.blocks.num_free == llm.engine.target.blocks.num_blocks


def test_bad_config_is_refused(target):
    with pytest.raises(ValueError, match="K"):
        LLM(target=target, draft=target, mode="sd", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="mode"):
        LLM(target, mode="fast")
    with pytest.raises(ValueError, match="CUDA|cuda"):
        LLM(target, device="cuda:3")


def test_an_ar_step_reads_from_the_device_once(monkeypatch):
    """Sampling runs where the logits are; the host reads the new tokens once per step (on a GPU, the
    step's one sync; tests/host_reads.py follows device values on the CPU)."""
    from saguaro.engine.decoder import ARDecoder
    from tests.host_reads import reads_per_call
    with LLM(tiny_model(seed=3), block_size=4) as llm, reads_per_call(monkeypatch, ARDecoder, "decode") as per_step:
        params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=1.0, seed=3, top_p=0.9)]
        llm.generate([[1, 2, 3], [5, 9, 13, 17]], params)
    assert per_step and all(n == 1 for n in per_step), per_step
