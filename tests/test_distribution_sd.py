"""SD at temperature > 0 samples exactly the target's distribution (50,000 samples per case).

The first two generated tokens' joint law is compared with the exact AR law by total
variation; the threshold derivation is in tests/dist_harness.py and tests/stats.py.
A deliberately wrong verifier (after a rejection it draws the bonus token from p instead of
the residual max(p - q, 0)) must fail the same check, which shows the test has teeth.
Every engine here runs a fixed K (``adaptive=False``), the paths it names; adaptive K has its own
check, tests/test_distribution_adapt.py.
"""
import pytest
import torch

import saguaro.sd.sd as sd_module
from saguaro import LLM, SamplingParams
from saguaro.verify.rejection import rejection_sample
from tests.dist_harness import measure
from tests.tiny import perturbed, tiny_model

# Every sampling setting is covered at K=1 and at K=3 without the full cross product.
CASES = [(1, SamplingParams(temperature=0.6)),
         (1, SamplingParams(temperature=1.0, top_p=0.9)),
         (3, SamplingParams(temperature=1.0)),
         (3, SamplingParams(temperature=0.6, top_p=0.9))]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=5, vocab=16, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.03)  # acceptance about one half: both branches matter


def sd_llm(pair, k):
    return LLM(adaptive=False, target=pair[0], draft=pair[1], mode="sd", num_speculative_tokens=k, block_size=4,
               max_num_seqs=1024, kv_cache_tokens=1024 * 16)


@pytest.mark.parametrize("k, params", CASES, ids=["k1-t0.6", "k1-t1.0-top_p0.9", "k3-t1.0", "k3-t0.6-top_p0.9"])
def test_sd_distribution(pair, k, params):
    tv, threshold = measure(sd_llm(pair, k), pair[0], params, positions=[0, 1])
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def test_ngram_sd_distribution(pair):
    llm = LLM(adaptive=False, target=pair[0], mode="sd", proposer="ngram", num_speculative_tokens=3, block_size=4,
              max_num_seqs=1024, kv_cache_tokens=1024 * 16)
    tv, threshold = measure(llm, pair[0], SamplingParams(temperature=1.0), positions=[1, 2])
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def wrong_verifier(target_probs, draft_tokens, draft_probs, num_draft, point_mass, generators, greedy, **kw):
    """Correct acceptance test, but after a rejection the bonus comes from p, not the residual."""
    result = rejection_sample(target_probs, draft_tokens, draft_probs, num_draft, point_mass, generators, greedy, **kw)
    for b, k in enumerate(result.num_accepted):
        if k < int(num_draft[b]):
            bonus = int(torch.multinomial(target_probs[b, k], 1, generator=generators[b]))
            result.bonus_tokens[b] = bonus
            result.output_tokens[b][-1] = bonus
    return result


def test_negative_control_wrong_verifier_fails(pair, monkeypatch):
    monkeypatch.setattr(sd_module, "rejection_sample", wrong_verifier)
    tv, threshold = measure(sd_llm(pair, 3), pair[0], SamplingParams(temperature=1.0), positions=[0, 1])
    assert tv > threshold, f"the check did not catch a wrong verifier (TV {tv:.4f} < {threshold:.4f})"
