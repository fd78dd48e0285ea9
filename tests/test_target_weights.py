"""A quantized target (``target_weights="int8"/"int4"``): a smaller model, and SD / SSD exact to it.

The target's matrices are packed as the CPU kernels' int8 or int4 format: the model is then that quantized model
(as a Q8/Q4 GGUF is a model of its own), so its AR output is the reference. Checks:
  * the target runs the CPU kernels in that format (bf16 weights packed from the checkpoint);
  * greedy SD and SSD (thread and process transports, int4 or int8 drafts) equal that target's AR token for token, on a
    tiny random model and on SmolLM2-135M's real file;
  * what cannot hold a quantized target is refused (a GPU, tensor parallelism, the eager reference, a bad name).
"""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.backends.cpu_kernels.model import FastCausalLM
from saguaro.cli import build_parser
from saguaro.config import Config
from saguaro.loading import load_model
from tests.tiny import PROMPTS, tiny_model, truncated


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=4, sharpness=3.0)


def _generate(llm, prompts, max_tokens=24):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]


@pytest.fixture(scope="module")
def ar(target):
    out = {}
    for weights in ("int8", "int4"):
        with LLM(target, block_size=4, target_weights=weights) as llm:
            net = llm.engine.target.net
            assert isinstance(net, FastCausalLM) and net.weights == weights
            assert next(target.model.parameters()).dtype == torch.float32  # the caller's model is untouched
            out[weights] = _generate(llm, PROMPTS)
    return out


@pytest.mark.parametrize("weights, mode, options", [
    ("int4", "sd", {}),
    ("int4", "ssd", dict(speculator_transport="thread", fan_out=[2, 2, 2, 4])),
    ("int4", "ssd", dict(speculator_transport="process", fan_out=[2, 2, 2, 4])),
    ("int8", "sd", {}),
], ids=["int4-sd", "int4-ssd-thread", "int4-ssd-process", "int8-sd"])
def test_greedy_sd_and_ssd_equal_the_quantized_targets_ar(target, ar, weights, mode, options):
    with LLM(target=target, draft=truncated(target, 2), mode=mode, num_speculative_tokens=3, block_size=4,
             target_weights=weights, draft_weights="int4", worker_timeout_s=60, adaptive=False,  # drafts every round
             **options) as llm:
        outs = _generate(llm, PROMPTS)
        metrics = llm.spec_metrics(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8)))
        assert getattr(llm.engine.decoder, "failure", None) is None
    assert outs == ar[weights]
    assert metrics.drafted_tokens > 0


def test_int4_target_sd_equals_its_ar_on_every_tier(target, cpu_tier, monkeypatch):
    """The same check through each CPU kernel tier this machine executes (its int4 GEMM differs per tier)."""
    monkeypatch.setenv("SAGUARO_CPU_TIER", cpu_tier)
    with LLM(target, block_size=4, target_weights="int4") as llm:
        assert llm.engine.target.net.tier == cpu_tier
        expected = _generate(llm, PROMPTS)
    with LLM(target=target, draft=truncated(target, 2), mode="sd", num_speculative_tokens=3, block_size=4,
             target_weights="int4", draft_weights="int4") as llm:
        assert _generate(llm, PROMPTS) == expected


@pytest.mark.parametrize("options, message", [
    (dict(device="cuda:0"), "use device='cpu'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=1"),
    (dict(enforce_eager=True), "enforce_eager=True runs the eager reference"),
    (dict(target_weights="int3"), "target_weights must be one of"),
])
def test_what_cannot_hold_a_quantized_target_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Config(target="t", **{"target_weights": "int4", "dtype": "bfloat16", **options})


def test_the_cli_takes_target_weights():
    args = build_parser().parse_args(["generate", "--target", "smollm2-135m", "--target-weights", "int4",
                                      "--prompt", "x"])
    assert args.target_weights == "int4"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_int4_smollm_target_sd_and_ssd_equal_its_ar(mode):
    """SmolLM2-135M's real file as an int4 target, drafted by the same file in int8: a different quantization of
    the same weights, so the draft is close to the target without being it."""
    target = load_model("smollm2-135m")
    prompts = ["def fibonacci(n):", "The capital of France is"]
    with LLM(target, target_weights="int4") as llm:
        expected = _generate(llm, prompts, 32)
    extra = dict(fan_out=[1, 1, 1, 1, 2]) if mode == "ssd" else {}
    with LLM(target=target, draft=target, mode=mode, num_speculative_tokens=4, target_weights="int4",
             draft_weights="int8", **extra) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32))
        metrics = llm.spec_metrics(outs)
    assert [o.token_ids for o in outs] == expected
    assert 0.3 < metrics.acceptance_rate < 1.0
