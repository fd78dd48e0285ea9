"""Lossless SSD: greedy equality with AR across hits and misses, batching, worker death.

Every case runs through both transports: the speculator process and the speculator thread
(saguaro/ssd/thread_link.py), which must give the same tokens.
"""
import itertools
import os
import signal
import sys
import threading

import pytest

from saguaro import LLM, SamplingParams
from saguaro.ssd.speculator import Speculator
from saguaro.ssd import thread_link
from tests.dist_harness import in_process
from tests.tiny import PROMPTS, greedy_tokens, perturbed, tiny_model, truncated

TRANSPORTS = ["process", "thread"]


@pytest.fixture(scope="module")
def ar_outputs(pair):
    return greedy_tokens(pair[0], PROMPTS, 24)


def ssd(pair, **kw):
    # a fixed K: these cases exercise hits, misses and the transports (adaptive K: tests/test_adapt_exact.py)
    options = dict(mode="ssd", num_speculative_tokens=3, block_size=4, worker_timeout_s=60, adaptive=False)
    options.update(kw)
    return LLM(target=pair[0], draft=pair[1], **options)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fan_out, fallback, taper", [
    ([2, 2, 2, 4], "jit", {}), ([0, 0, 0, 0], "jit", {}), ([1, 1, 1, 2], "ngram", {}), ([1, 1, 1, 1], "random", {}),
    ([1, 1, 1, 2], "skip", {}),  # a miss takes an AR step
    ([2, 2, 2, 4], "jit", dict(branch_steps=1, deep_branches=2)),  # tapered tree: hits of 1 and 3 tokens
])
def test_greedy_ssd_equals_ar(pair, ar_outputs, fan_out, fallback, taper, transport):
    switch = sys.getswitchinterval()
    with ssd(pair, fan_out=fan_out, miss_strategy=fallback, speculator_transport=transport, **taper) as llm:
        link = llm.engine.decoder.link
        if transport == "thread":  # the target gets the interpreter lock back from the build within 0.2 ms
            assert sys.getswitchinterval() == pytest.approx(min(switch, thread_link.SWITCH_INTERVAL_S))
        single = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24))[0]
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
        metrics = llm.spec_metrics(outs)
        trace = llm.engine.decoder.trace
        failure = llm.engine.decoder.failure
    assert failure is None  # the worker served every round (its fault path would also equal AR)
    assert single.token_ids == ar_outputs[1]
    assert [o.token_ids for o in outs] == ar_outputs
    if sum(fan_out) == 0:
        assert metrics.cache_hit_rate == 0
    elif fan_out[-1] >= 2 and fallback in ("jit", "skip"):
        # (after an n-gram backup speculation the tiny random pair hits about 1 round in 90, too few to assert on
        # 24 tokens; whether those rounds hit depends on how far each build got)
        assert metrics.cache_hit_rate > 0
    assert any(t.build_steps for t in trace) or sum(fan_out) == 0
    assert llm.engine.target.blocks.num_free == llm.engine.target.blocks.num_blocks
    if transport == "thread":
        assert not link.thread.is_alive()  # close() stopped and joined it
    assert sys.getswitchinterval() == switch  # restored once the last thread link closed


def test_rounds_after_an_ngram_backup_speculation_hit():
    """A miss's n-gram backup speculation is verified like any other, and the build beside it prepares its
    outcomes: the next round can hit. On an 8-token vocabulary with F = [1, 8] (every all-accepted outcome cached,
    one guess at a rejection's bonus), about 4 rounds in 10 after a miss hit; greedy outputs stay AR's."""
    target = tiny_model(seed=5, vocab=8, layers=2, sharpness=2.0)
    draft = perturbed(target, noise=0.03)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 0, 1], [3, 3]]
    llm = in_process(LLM(target=target, draft=draft, mode="ssd", num_speculative_tokens=1, fan_out=[1, 8],
                         miss_strategy="ngram", adaptive=False, block_size=4))  # every build completes
    with llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=40))
        metrics = llm.spec_metrics(outs)
    assert [o.token_ids for o in outs] == greedy_tokens(target, prompts, 40)
    assert metrics.cache_hit_rate < 1  # some rounds missed, and took the backup
    assert metrics.hit_rate_after_miss > 0.1, metrics


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_request_joining_mid_flight(pair, ar_outputs, transport):
    with ssd(pair, fan_out=[2, 2, 2, 3], speculator_transport=transport) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=24)
        first = engine.add_request(PROMPTS[1], params)
        for _ in range(5):
            engine.step()
        late = engine.add_request(PROMPTS[3], params)
        while engine.has_unfinished:
            engine.step()
    assert first.output_ids == ar_outputs[1]
    assert late.output_ids == ar_outputs[3]


@pytest.mark.worker_failure
def test_worker_kill_mid_generation(pair, ar_outputs):
    llm = ssd(pair, fan_out=[1, 1, 1, 2])
    engine = llm.engine
    params = SamplingParams(max_tokens=24)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    os.kill(engine.decoder.link.process.pid, signal.SIGKILL)
    while engine.has_unfinished:
        engine.step()
    assert engine.decoder.failure is not None
    assert [s.output_ids for s in seqs] == ar_outputs
    assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
    llm.close()


def _fault_at(monkeypatch, method: str, call: int, fault) -> None:
    """Make the speculator thread's ``call``-th call of ``Speculator.method`` run ``fault()`` first."""
    real, calls = getattr(Speculator, method), itertools.count()

    def faulty(self, *args, **kwargs):
        if next(calls) == call:
            fault()
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Speculator, method, faulty)


def _finish_after_failure(llm, ar_outputs) -> str:
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in PROMPTS]
    while engine.has_unfinished:
        engine.step()
    assert [s.output_ids for s in seqs] == ar_outputs
    assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
    return engine.decoder.failure


@pytest.mark.worker_failure
@pytest.mark.parametrize("method", ["respond", "build"])
def test_speculator_thread_raising(pair, ar_outputs, monkeypatch, method):
    def fail():
        raise RuntimeError("injected speculator fault")
    _fault_at(monkeypatch, method, 3, fail)
    with ssd(pair, fan_out=[1, 1, 1, 2], speculator_transport="thread") as llm:
        link = llm.engine.decoder.link
        failure = _finish_after_failure(llm, ar_outputs)
    assert "injected speculator fault" in failure
    link.thread.join(10)
    assert not link.thread.is_alive()


@pytest.mark.worker_failure
def test_speculator_thread_silent(pair, ar_outputs, monkeypatch):
    """A thread that stops answering is given up on after worker_timeout_s; the target never waits longer."""
    release = threading.Event()
    _fault_at(monkeypatch, "respond", 3, lambda: release.wait(60))
    with ssd(pair, fan_out=[1, 1, 1, 2], speculator_transport="thread", worker_timeout_s=2) as llm:
        link = llm.engine.decoder.link
        try:
            failure = _finish_after_failure(llm, ar_outputs)
        finally:
            release.set()
    assert "no response" in failure
    link.thread.join(10)  # once released, it sees the stop request and ends
    assert not link.thread.is_alive()


def test_speculator_thread_start_up_failure(pair, monkeypatch):
    def broken(draft, opts, recorder=None):
        raise RuntimeError("no draft here")
    monkeypatch.setattr(thread_link, "start_speculator", broken)
    switch = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="speculator thread failed during start-up.*no draft here"):
        ssd(pair, speculator_transport="thread")
    assert sys.getswitchinterval() == switch


@pytest.mark.parametrize("bad, message", [
    (dict(fan_out=[1, -1, 1, 1]), "fan_out"),
    (dict(fan_out=[1, 1]), "K\\+1"),
    (dict(fan_out=[1, 1, 1, 10_000]), "vocabulary"),
    (dict(draft_device="cuda:7"), "cuda|CUDA"),
    (dict(num_speculative_tokens=0), "K"),
    (dict(branch_steps=4), "branch_steps"),  # K = 3
    (dict(branch_steps=0), "branch_steps"),
    (dict(branch_steps=2, deep_branches=0), "deep_branches"),
    (dict(speculator_transport="threads"), "speculator_transport"),
])
def test_bad_ssd_config(pair, bad, message):
    with pytest.raises(ValueError, match=message):
        ssd(pair, **bad)


def test_fast_path_through_the_speculator_thread():
    """The bf16 kernels release the interpreter lock, so the target's and the draft's passes run at the same time in
    one process; each keeps its own results (greedy output equals the same engine's AR, as over the process)."""
    target = tiny_model(seed=4, sharpness=8.0, layers=3)
    prompts, params = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29], [7, 8]], SamplingParams(max_tokens=24)
    common = dict(dtype="bfloat16", block_size=4, kv_cache_tokens=512)
    with LLM(target, **common) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(target=target, draft=truncated(target, 1), mode="ssd", num_speculative_tokens=3, fan_out=[1, 1, 1, 2],
             speculator_transport="thread", **common) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
