"""SD and SSD with an EAGLE-3 draft at temperature > 0 sample exactly the target's distribution.

The first two output tokens' joint law is compared with the exact AR law by total variation, with the
threshold that ``tests/stats.py`` derives for this n (false-failure probability 1e-6). The head is random and
covers 12 of the 16 ids, so drafts are accepted about half the time and some target ids are never drafted.
Negative control: a proposer that reports its distribution on ids shifted by one (as a wrong d2t map would)
must fail.

SSD (thread transport, K=1, fan-out [2, 3], vocabulary 8 so that the exact law of tokens 3 and 4 stays cheap):
token 0 comes from the prefill and round 1 is a miss (the sequence is new), so tokens 3 and 4 come from rounds
whose speculation was a cache hit (drafted with the head's own features past the verified prefix) or a
just-in-time miss. The same shifted-ids control, planted in the speculator's draws, must fail.
Every engine here runs a fixed K (``adaptive=False``), the paths it names; adaptive K has its own
check, tests/test_distribution_adapt.py.
"""
import pytest
import saguaro.eagle.proposer as proposer_module
import saguaro.sd.draft_model as draft_model_module
import saguaro.ssd.speculator as speculator_module
from saguaro import LLM, SamplingParams
from tests.dist_harness import measure
from tests.eagle_heads import random_head_dir
from tests.tiny import tiny_model

N = 8_000  # the threshold is derived for this n (about 0.12 over the 256 two-token outcomes)
N_CONTROL = N  # the shifted ids move the law by about 0.2 in TV: the main test's n (threshold about 0.12) sees it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_model(seed=5, vocab=16, layers=4, sharpness=2.0)
    return target, random_head_dir(target, tmp_path_factory, "speculators", draft_vocab=12, seed=7, scale=0.5)


def eagle_llm(setup, k):
    return LLM(adaptive=False, target=setup[0], draft=setup[1], mode="sd", num_speculative_tokens=k, block_size=4,
               max_num_seqs=1024, kv_cache_tokens=1024 * 16)


@pytest.mark.parametrize("k, params", [(3, SamplingParams(temperature=1.0)),
                                       (2, SamplingParams(temperature=0.6, top_p=0.9))],
                         ids=["k3-t1.0", "k2-t0.6-p0.9"])
def test_eagle_sd_distribution(setup, k, params):
    tv, threshold = measure(eagle_llm(setup, k), setup[0], params, positions=[0, 1], n=N)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def test_negative_control_shifted_draft_ids_fail(setup, monkeypatch):
    original_sample = proposer_module.sample

    def sample_then_shift(probs, generators, greedy):
        drawn = original_sample(probs, generators, greedy)
        probs.copy_(probs.roll(1, -1))  # the proposal records q on the wrong ids
        return drawn

    monkeypatch.setattr(proposer_module, "sample", sample_then_shift)
    tv, threshold = measure(eagle_llm(setup, 3), setup[0], SamplingParams(temperature=1.0), positions=[0, 1],
                            n=N_CONTROL)
    assert tv > threshold, f"the check did not catch q on shifted ids (TV {tv:.4f} < {threshold:.4f})"


SSD_POSITIONS = [3, 4]
# the speculator's per-sequence work bounds SSD's n (about 15 s per 1,000 requests on one core); the threshold is
# derived for it (about 0.12 over the 64 two-token outcomes; 0.21 for the control)
N_SSD = 3_000
N_SSD_CONTROL = 1_000


@pytest.fixture(scope="module")
def ssd_setup(tmp_path_factory):
    target = tiny_model(seed=5, vocab=8, layers=4, sharpness=2.0)
    return target, random_head_dir(target, tmp_path_factory, "hf", draft_vocab=6, seed=7, scale=0.5)


def eagle_ssd_run(ssd_setup, n):
    llm = LLM(target=ssd_setup[0], draft=ssd_setup[1], mode="ssd", num_speculative_tokens=1, fan_out=[2, 3],
              adaptive=False, speculator_transport="thread", block_size=4, max_num_seqs=1024, kv_cache_tokens=1024 * 16)
    try:
        tv, threshold = measure(llm, ssd_setup[0], SamplingParams(temperature=1.0), SSD_POSITIONS, n=n)
        assert llm.engine.decoder.failure is None  # every round went through the speculator
        hits = [h for t in llm.engine.decoder.trace for h in t.hits]
    finally:
        llm.close()
    return tv, threshold, sum(hits) / len(hits)


def test_eagle_ssd_distribution(ssd_setup):
    tv, threshold, hit_rate = eagle_ssd_run(ssd_setup, N_SSD)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert 0.1 < hit_rate < 0.95, f"hit rate {hit_rate:.3f}: hits and misses should both occur"


def test_negative_control_ssd_shifted_draft_ids_fail(ssd_setup, monkeypatch):
    """The speculator's branch steps and just-in-time drafts report q on ids shifted by one."""
    for module in (speculator_module, draft_model_module):
        original = module.sample

        def sample_then_shift(probs, generators, greedy, original=original):
            drawn = original(probs, generators, greedy)
            probs.copy_(probs.roll(1, -1))
            return drawn

        monkeypatch.setattr(module, "sample", sample_then_shift)
    tv, threshold, _ = eagle_ssd_run(ssd_setup, N_SSD_CONTROL)
    assert tv > threshold, f"the check did not catch q on shifted ids (TV {tv:.4f} < {threshold:.4f})"
