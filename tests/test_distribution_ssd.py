"""SSD at temperature > 0 samples exactly the target's distribution: hits, misses, and both.

K = 1, vocabulary 8. Prefill yields token 0; the first verification (a just-in-time
speculation, the sequence is new to the speculator) yields token 1 and maybe 2; so tokens 3
and 4 always come from rounds whose speculation went through the cache (a hit) or through
the fallback (a miss). Their joint law is compared with the exact AR law by total
variation over 50,000 seeded requests (threshold derivation: tests/dist_harness.py).

- all hits: fan-out 8 at both depths covers every possible outcome on an 8-token vocabulary;
- all misses: fan-out 0 prepares nothing, so every round takes the fallback;
- mixed: fan-out [1, 2], with top-p, gives both in one batch.
Misses are drafted just in time (the sampled drafts the verifier judges against q); the point-mass backups
and skipped misses have their own check (tests/test_saguaro_distribution.py).
The negative control plants a wrong verifier and must fail the same check.

The mixed case and the negative control also run through the thread transport (the
speculator in a thread of the engine's process, messages passed as objects); the others
through the process only, to keep the suite's time down.
Every engine here runs a fixed K (``adaptive=False``), the paths it names; adaptive K has its own
check, tests/test_distribution_adapt.py.
"""
import pytest

import saguaro.sd.sd as sd_module
from saguaro import LLM, SamplingParams
from tests.dist_harness import in_process, measure
from tests.test_distribution_sd import wrong_verifier
from tests.tiny import perturbed, tiny_model

POSITIONS = [3, 4]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=5, vocab=8, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.03)


def run(pair, fan_out, params, n=50_000, positions=POSITIONS, **options):
    llm = LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=len(fan_out) - 1, fan_out=fan_out,
              adaptive=False, block_size=4, max_num_seqs=1024, kv_cache_tokens=1024 * 16, miss_strategy="jit",
              **options)
    try:
        tv, threshold = measure(llm, pair[0], params, positions, n)
        trace = llm.engine.decoder.trace
        assert llm.engine.decoder.failure is None  # every round went through the speculator
    finally:
        llm.close()
    hits = [h for t in trace for h in t.hits]
    return tv, threshold, sum(hits) / len(hits)


@pytest.mark.parametrize("fan_out, params, hit_range, transport", [
    ([8, 8], SamplingParams(temperature=1.0), (0.6, 1.0), "process"),
    ([0, 0], SamplingParams(temperature=1.0), (0.0, 0.0), "process"),
    ([1, 2], SamplingParams(temperature=0.8, top_p=0.9), (0.1, 0.9), "process"),
    ([1, 2], SamplingParams(temperature=0.8, top_p=0.9), (0.1, 0.9), "thread"),
], ids=["all-hits", "all-misses", "mixed", "mixed-thread"])
def test_ssd_distribution(pair, fan_out, params, hit_range, transport):
    tv, threshold, hit_rate = run(pair, fan_out, params, speculator_transport=transport)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert hit_range[0] <= hit_rate <= hit_range[1], f"hit rate {hit_rate:.3f} outside {hit_range}"


@pytest.mark.parametrize("fan_out, params, options, n", [
    ([8, 8], SamplingParams(temperature=1.0), {}, 10_000),
    ([1, 2, 2], SamplingParams(temperature=0.8, top_p=0.9), dict(branch_steps=1, deep_branches=1), 5_000),
], ids=["all-hits", "mixed-tapered"])
def test_ssd_distribution_through_the_graph_build(pair, fan_out, params, options, n, monkeypatch):
    """The speculator's graph build (the paged backend's, on its CPU stand-in; counter uniforms) samples exactly
    too. With every outcome cached every build is a graph replay; with a tapered tree a hit on a short branch
    brings a speculation of fewer than K tokens, which the graph does not build (the Python build does, from the
    same counter uniforms), so that run mixes the two."""
    from saguaro.ssd.speculator import Speculator
    from tests.test_backends import use_paged_backend
    use_paged_backend(monkeypatch)
    builds = {"graph": 0, "python": 0}
    real_graph, real_python = Speculator._replay_build, Speculator._decode_branches
    monkeypatch.setattr(Speculator, "_replay_build",
                        lambda self, *a: builds.__setitem__("graph", builds["graph"] + 1) or real_graph(self, *a))
    monkeypatch.setattr(Speculator, "_decode_branches",
                        lambda self, *a: builds.__setitem__("python", builds["python"] + 1) or real_python(self, *a))
    positions = [4, 5] if len(fan_out) == 3 else POSITIONS
    llm = LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=len(fan_out) - 1, fan_out=fan_out,
              adaptive=False, block_size=4, max_num_seqs=256, kv_cache_tokens=256 * 64, max_model_len=16,
              speculator_transport="thread", **options)  # short tables: the paged stand-in attends to all of them
    with llm:
        tv, threshold = measure(llm, pair[0], params, positions, n)
        assert llm.engine.decoder.failure is None
        hits = [h for t in llm.engine.decoder.trace for h in t.hits]
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert builds["graph"] > 0 and (builds["python"] == 0) == (options == {}), builds
    assert sum(hits) / len(hits) > 0.1


def test_tapered_tree_distribution(pair):
    """K = 2 with a tapered tree: every branch gets one step, only the likeliest a second, so cached
    speculations of one and two tokens (and misses) mix; tokens 4 and 5 come from round 2 or later."""
    tv, threshold, hit_rate = run(pair, [1, 2, 2], SamplingParams(temperature=1.0), positions=[4, 5],
                                  branch_steps=1, deep_branches=1)
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert 0.1 < hit_rate < 0.95


def test_all_hits_after_the_first_round(pair):
    """With every outcome cached, only each request's first verified round can miss."""
    llm = in_process(LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=1, fan_out=[8, 8],
                         adaptive=False, block_size=4))  # every build completes: no round misses for want of time
    with llm:
        outs = llm.generate([[3, 7, 1]] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=12) for i in range(8)])
        metrics = llm.spec_metrics(outs)
    assert metrics.hit_rate_after_hit == 1.0 and metrics.hit_rate_after_miss == 1.0


@pytest.mark.parametrize("transport", ["process", "thread"])
def test_negative_control_wrong_verifier_fails(pair, monkeypatch, transport):
    monkeypatch.setattr(sd_module, "rejection_sample", wrong_verifier)
    tv, threshold, _ = run(pair, [1, 2], SamplingParams(temperature=1.0), n=20_000, speculator_transport=transport)
    assert tv > threshold, f"the check did not catch a wrong verifier (TV {tv:.4f} < {threshold:.4f})"
