"""CUDA path: the same engine on a GPU. Skipped cleanly where no GPU is present (CI)."""
import pytest
import torch

from saguaro import LLM, SamplingParams
from tests.tiny import tiny_model, truncated

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 2, 3], [5, 9, 13, 17, 21], [7]]


def _cpu_reference():
    with LLM(tiny_model(seed=3, layers=3, sharpness=3.0), block_size=4) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))]


def test_ar_on_cuda_matches_cpu():
    expected = _cpu_reference()
    with LLM(tiny_model(seed=3, layers=3, sharpness=3.0), device="cuda:0", block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))] == expected


def test_sd_on_cuda_matches_cpu():
    expected = _cpu_reference()
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    with LLM(target=target, draft=truncated(target, 1), mode="sd", device="cuda:0", block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))] == expected


def _ssd_on_cuda(**placement) -> list[list[int]]:
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    with LLM(target=target, draft=truncated(target, 1), mode="ssd", device="cuda:0", num_speculative_tokens=3,
             fan_out=[1, 1, 1, 2], block_size=4, **placement) as llm:
        assert llm.config.speculator_transport == placement.get("speculator_transport", "thread")
        outputs = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))]
        assert llm.engine.decoder.failure is None
    return outputs


def test_ssd_thread_on_one_gpu_matches_cpu():
    """The colocated speculator: a thread of the target's process on the same GPU, its own CUDA stream."""
    assert _ssd_on_cuda(draft_device="cuda:0") == _cpu_reference()


def test_ssd_thread_in_a_green_context_matches_cpu(monkeypatch):
    """The speculator confined to a share of the SMs (where torch has green contexts; else it warns and shares)."""
    import saguaro.ssd.thread_link as thread_link
    real = thread_link.ThreadLink.__init__
    monkeypatch.setattr(thread_link.ThreadLink, "__init__",
                        lambda self, draft, opts, sms=None: real(self, draft, opts, sms=16))
    assert _ssd_on_cuda(draft_device="cuda:0") == _cpu_reference()


def test_ssd_process_on_the_targets_gpu_is_refused():
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        _ssd_on_cuda(draft_device="cuda:0", speculator_transport="process")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ssd_over_nccl_on_two_gpus_matches_cpu():
    """The paper's setting: the draft on the next GPU, in its own process, over NCCL."""
    assert _ssd_on_cuda(speculator_transport="process") == _cpu_reference()
