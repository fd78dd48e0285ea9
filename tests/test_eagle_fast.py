"""EAGLE-3 target features from the CPU kernels: a bf16 target keeps its fast path under an EAGLE-3 draft.

The CPU kernels run every decoder layer in one C++ call; with taps the call is split at each tapped layer, so
the tapped inputs come out between the parts. Checks:
  * the split changes nothing: hidden states and the KV cache equal the unsplit call's bit for bit;
  * the features are the eager model's within bf16 rounding (as the rest of the fast path is);
  * greedy SD and SSD (thread and process) with a random head on a bf16 target running the CPU kernels equal
    that target's AR token for token;
  * a backend that cannot tap (the paged GPU path) is refused with a message that says which can.
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


@pytest.fixture(scope="module")
def bf16_net(target):
    model = tiny_model(seed=3, layers=4, sharpness=3.0).model.to(torch.bfloat16)
    return model, FastCausalLM(model)


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


def test_a_backend_that_cannot_tap_is_refused(target):
    runner = ModelRunner(target.model, 16, 4, backend="paged")  # on the CPU: torch reference ops
    with pytest.raises(ValueError, match="eager or CPU-kernel backend, not 'paged'"):
        runner.tap([1, 3], lambda items, features: None)
    table: list[int] = []
    runner.blocks.reserve(table, 3)
    runner.forward([ForwardItem([1, 2, 3], 0, table, "all")])  # and it still runs untapped
