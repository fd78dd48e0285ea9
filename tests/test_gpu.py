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


def test_ssd_over_nccl_matches_cpu():
    expected = _cpu_reference()
    target = tiny_model(seed=3, layers=3, sharpness=3.0)
    draft_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    with LLM(target=target, draft=truncated(target, 1), mode="ssd", device="cuda:0", draft_device=draft_device,
             num_speculative_tokens=3, fan_out=[1, 1, 1, 2], block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))] == expected
