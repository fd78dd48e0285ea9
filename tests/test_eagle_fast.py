"""EAGLE-3 target features from every backend: a target keeps its fast path under an EAGLE-3 draft.

The CPU kernels run every decoder layer in one C++ call; with taps the call is split at each tapped layer, so
the tapped inputs come out between the parts. Checks:
  * the split changes nothing: hidden states and the KV cache equal the unsplit call's bit for bit;
  * the features are the eager model's within bf16 rounding (as the rest of the fast path is);
  * greedy SD and SSD (thread and process) with a random head on a bf16 target running the CPU kernels equal
    that target's AR token for token;
  * the paged path's graphs (their CPU stand-in here) copy the features out; EAGLE SD and SSD on it equal AR;
    taps other than the ones its graphs were captured with are refused.
"""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.backends.cpu_kernels.model import FastCausalLM
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from tests.eagle_heads import random_head_dir
from tests.tiny import PROMPTS, tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=4, sharpness=3.0)


@pytest.fixture
def bf16_net(cpu_tier):
    """The bf16 model and its CPU kernels on each tier this machine executes."""
    model = tiny_model(seed=3, layers=4, sharpness=3.0).model.to(torch.bfloat16)
    return model, FastCausalLM(model, tier=cpu_tier)


def _pass(net, taps):
    net.taps = taps
    cache = KVCache(net.config, 8, 16, torch.bfloat16)
    meta = build_metadata([list(range(20)), list(range(40, 47))], [20, 7])
    ids = torch.arange(27) % net.config.vocab_size
    positions = torch.cat((torch.arange(20), torch.arange(7)))
    try:
        with torch.inference_mode():
            hidden = net(ids, positions, cache, meta)
        return hidden, cache.data, net.tapped
    finally:
        net.taps = ()


@pytest.mark.parametrize("taps", [(3, 1), (0, 2), (1, 2, 3)])
def test_taps_split_the_fused_call_without_changing_it(bf16_net, taps):
    model, fast = bf16_net
    plain, plain_cache, _ = _pass(fast, ())
    hidden, cache, features = _pass(fast, taps)
    assert torch.equal(hidden, plain) and torch.equal(cache, plain_cache)
    _, _, eager = _pass(model, taps)
    assert features.shape == eager.shape == (27, len(taps) * model.config.hidden_size)
    scale = eager.float().abs().max()
    assert (features.float() - eager.float()).abs().max() <= 0.03 * scale
    if taps[0] == 0:  # the first layer's input is the embedding itself
        width = model.config.hidden_size
        assert torch.equal(features[:, :width], model.model.embed_tokens(torch.arange(27) % model.config.vocab_size))


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    return random_head_dir(target, tmp_path_factory, "midlayer", draft_vocab=48, seed=1)


@pytest.fixture(scope="module")
def bf16_ar(target):
    with LLM(target, dtype="bfloat16", block_size=4) as llm:
        assert isinstance(llm.engine.target.net, FastCausalLM)
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24))]


@pytest.mark.parametrize("mode, options", [
    ("sd", {}),
    ("ssd", dict(speculator_transport="thread", fan_out=[2, 2, 2, 4])),
    ("ssd", dict(speculator_transport="process", fan_out=[2, 2, 2, 4], max_prefill_tokens=3)),
], ids=["sd", "ssd-thread", "ssd-process-chunked"])
def test_greedy_eagle_on_cpu_kernels_equals_ar(target, head_dir, bf16_ar, mode, options):
    with LLM(target=target, draft=str(head_dir), mode=mode, num_speculative_tokens=3, dtype="bfloat16",
             block_size=4, worker_timeout_s=60, **options) as llm:
        assert isinstance(llm.engine.target.net, FastCausalLM)  # the head no longer forces the eager target
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
        metrics = llm.spec_metrics(outs)
        assert getattr(llm.engine.decoder, "failure", None) is None
    assert [o.token_ids for o in outs] == bf16_ar
    assert metrics.drafted_tokens > 0


def _causal_pass(runner, n=5):
    table: list[int] = []
    runner.blocks.reserve(table, n)
    runner.forward([ForwardItem(list(range(1, n + 1)), 0, table, "all")])


def test_paged_graphs_copy_the_tapped_features_out(target):
    """The paged path's graphs (the CPU stand-in here) copy the tapped layers' inputs into a buffer of their own;
    each pass hands out a copy, which the next replay leaves alone. Taps other than the captured ones are refused."""
    seen: list[torch.Tensor] = []
    eager = ModelRunner(target.model, 16, 4)
    eager.tap([3, 1], lambda items, features: seen.append(features))
    try:
        _causal_pass(eager)
    finally:
        target.model.taps = ()
    paged = ModelRunner(target.model, 16, 4, backend="paged")
    paged.capture_graphs(8, taps=(3, 1))
    with pytest.raises(ValueError, match="captured tapping layers \\[3, 1\\], not \\[1, 3\\]"):
        paged.tap([1, 3], lambda items, features: None)
    paged.tap([3, 1], lambda items, features: seen.append(features))
    _causal_pass(paged)  # 5 rows: bucket 8's graph
    assert paged.backend.replays == 1
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-3, atol=1e-3)  # fp32, fused ops: rounding only
    kept = seen[1].clone()
    _causal_pass(paged, 3)
    assert torch.equal(seen[1], kept) and seen[2].shape == (3, 2 * target.config.hidden_size)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_eagle_on_the_paged_path_equals_ar(target, head_dir, mode, monkeypatch):
    """Every runner on the paged backend with graphs (the CPU stand-in): the target's graphs carry the head's taps."""
    from tests.test_backends import use_paged_backend
    with LLM(target, block_size=4, enforce_eager=True) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))]
    use_paged_backend(monkeypatch)
    options = dict(fan_out=[1, 1, 1, 2], speculator_transport="thread") if mode == "ssd" else {}
    with LLM(target=target, draft=str(head_dir), mode=mode, num_speculative_tokens=3, block_size=4,
             dtype="float32", **options) as llm:
        runner = llm.engine.target
        assert runner.backend.name == "paged" and runner.net.taps
        outs = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))]
        assert runner.backend.replays > 0
        assert getattr(llm.engine.decoder, "failure", None) is None
    assert outs == expected
