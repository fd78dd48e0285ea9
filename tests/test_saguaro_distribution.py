"""Saguaro sampling (Def. 14) and the point-mass backups keep SSD exact at temperature > 0.

Same set-up as tests/test_distribution_ssd.py (K = 1, vocabulary 8, 50,000 seeded requests, joint law of
output tokens 3 and 4 against the exact AR law by total variation, threshold from tests/dist_harness.py).
Every primary draw -- cached branches and just-in-time drafts -- comes from sigma_{F,C} with C = 0.3, so
the verifier must use the down-weighted q; misses go to the jit drafter, the n-gram backup (point-mass
drafts) or random tokens, or take an AR step (skip). Fan-out [1, 2] gives hits and misses in every batch.
Every engine here runs a fixed K (``adaptive=False``), the paths it names; adaptive K has its own
check, tests/test_distribution_adapt.py.
"""
import pytest

from saguaro import LLM, SamplingParams
from tests.dist_harness import in_process, measure
from tests.test_distribution_ssd import POSITIONS, pair  # noqa: F401  (fixture)


@pytest.mark.parametrize("strategy, c", [("jit", 0.3), ("ngram", 0.3), ("random", 0.3), ("skip", 0.3)])
def test_saguaro_sampling_and_miss_strategies_are_exact(pair, strategy, c):  # noqa: F811
    llm = LLM(adaptive=False, target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=1, fan_out=[1, 2],
              miss_strategy=strategy, saguaro_c=c, block_size=4, max_num_seqs=1024, kv_cache_tokens=1024 * 16)
    try:
        tv, threshold = measure(llm, pair[0], SamplingParams(temperature=1.0), POSITIONS)
        hits = [h for t in llm.engine.decoder.trace for h in t.hits]
    finally:
        llm.close()
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert 0.05 < sum(hits) / len(hits) < 0.95  # both hits and misses were exercised


def test_negative_control_recording_p_instead_of_q_fails(pair, monkeypatch):  # noqa: F811
    """Drafting from sigma_{1,0} but handing the verifier the unweighted p must fail the same check."""
    import torch

    import saguaro.sd.draft_model as draft_module
    import saguaro.ssd.speculator as speculator_module
    from saguaro.ssd.saguaro_sampling import saguaro_reweight

    real = speculator_module.sample

    def biased(probs, generators, greedy):
        n = probs.shape[0]
        return real(saguaro_reweight(probs, torch.ones(n, dtype=torch.long), torch.zeros(n)), generators, greedy)

    monkeypatch.setattr(speculator_module, "sample", biased)
    monkeypatch.setattr(draft_module, "sample", biased)
    llm = in_process(LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=1, fan_out=[1, 2],
                         adaptive=False, block_size=4, max_num_seqs=1024,
                         kv_cache_tokens=1024 * 16))  # the patch lives here
    try:
        tv, threshold = measure(llm, pair[0], SamplingParams(temperature=1.0), POSITIONS, n=20_000)
    finally:
        llm.close()
    assert tv > threshold, f"the check did not catch a wrong q (TV {tv:.4f} < {threshold:.4f})"
