"""Penalties and logit_bias at temperature 1 sample exactly the processed target law, through SD and SSD.

The law is the target's alone with the processors applied at every position for its own history
(tests/processor_reference.py, enumerating every continuation). Each case samples seeded requests
through the engine and compares, by total variation (threshold: tests/stats.py), two outcomes with
their exact laws: the joint law of the tokens at positions 1 and 2, and the pattern of repeats
``[t1 == t0] + 2 [t2 == t1] + 4 [t3 == t2]`` (8 outcomes). Position 0 is sampled at prefill, positions
1 to 3 by verification passes (K = 3; in SSD the second round is served from the
speculator's cache or its fallback), so positions 2 and 3 are often scored on rows that follow accepted
drafts: the penalties here all favour repeats, which makes a draft left uncounted visible in the
pattern. The negative control scores every row with the history before its pass and must fail.
"""
from dataclasses import replace

import pytest
import torch

import saguaro.sd.sd as sd_module
from saguaro import LLM, SamplingParams
from saguaro.sampling.logit_processors import apply_logit_processors
from tests.dist_harness import PROMPT
from tests.processor_reference import processed_law
from tests.stats import empirical, tv_distance, tv_threshold
from tests.tiny import perturbed, tiny_model

PENALTIES = SamplingParams(temperature=1.0, presence_penalty=-1.5, frequency_penalty=-0.5, repetition_penalty=0.8)
BIAS = SamplingParams(temperature=1.0, logit_bias={1: 2.0, 4: -3.0, 6: 1.0})
LENGTH = 4  # tokens t0..t3 are compared


def repeats(tokens: torch.Tensor) -> torch.Tensor:
    """[..., 4] tokens -> the repeat pattern in [0, 8)."""
    same = (tokens[..., 1:] == tokens[..., :-1]).long()
    return same[..., 0] + 2 * same[..., 1] + 4 * same[..., 2]


def statistics(law: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact laws of the outcomes compared, from the joint law of t0..t3."""
    vocab = law.shape[0]
    grid = torch.stack(torch.meshgrid(*[torch.arange(vocab)] * LENGTH, indexing="ij"), dim=-1)
    pattern = torch.zeros(8, dtype=torch.float64).index_add_(0, repeats(grid).reshape(-1), law.reshape(-1))
    return {"joint12": law.sum(dim=(0, 3)).reshape(-1), "repeats": pattern}


def measure(llm: LLM, target, params: SamplingParams, n: int) -> dict[str, tuple[float, float]]:
    """Per outcome, (TV between the engine's samples and the processed law, threshold)."""
    laws = statistics(processed_law(target, params, PROMPT, LENGTH))
    extra = llm.config.num_speculative_tokens  # so that no round is cut short before the positions compared
    outs = llm.generate([PROMPT] * n, [replace(params, seed=i, max_tokens=LENGTH + extra, ignore_eos=True)
                                       for i in range(n)])
    tokens = torch.tensor([o.token_ids[:LENGTH] for o in outs])
    vocab = target.config.vocab_size
    samples = {"joint12": tokens[:, 1] * vocab + tokens[:, 2], "repeats": repeats(tokens)}
    return {name: (tv_distance(empirical(samples[name], p.numel()), p), tv_threshold(n, int((p > 0).sum())))
            for name, p in laws.items()}


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=5, vocab=16, layers=2, sharpness=2.0)
    return target, perturbed(target, noise=0.03)


def sd(pair_):
    return LLM(target=pair_[0], draft=pair_[1], mode="sd", num_speculative_tokens=3, block_size=4,
               max_num_seqs=1024, kv_cache_tokens=1024 * 16)


def ssd(pair_):
    return LLM(target=pair_[0], draft=pair_[1], mode="ssd", num_speculative_tokens=3, fan_out=[1, 1, 1, 2],
               block_size=4, max_num_seqs=1024, kv_cache_tokens=1024 * 16)


@pytest.mark.parametrize("make, params, n", [(sd, PENALTIES, 30_000), (sd, BIAS, 30_000),
                                             (ssd, replace(PENALTIES, logit_bias=BIAS.logit_bias), 20_000)],
                         ids=["sd-penalties", "sd-logit_bias", "ssd-penalties-logit_bias"])
def test_distribution(pair, make, params, n):
    with make(pair) as llm:
        results = measure(llm, pair[0], params, n)
        assert getattr(llm.engine.decoder, "failure", None) is None
    for name, (tv, threshold) in results.items():
        assert tv < threshold, f"{name}: TV {tv:.4f} >= {threshold:.4f}"


def _drafts_not_counted(logits, seqs, rows, drafts):
    return apply_logit_processors(logits, seqs, rows)


@pytest.mark.parametrize("make", [sd, ssd], ids=["sd", "ssd"])
def test_negative_control_drafts_not_counted_fails(pair, monkeypatch, make):
    monkeypatch.setattr(sd_module, "apply_logit_processors", _drafts_not_counted)
    with make(pair) as llm:
        tv, threshold = measure(llm, pair[0], PENALTIES, 20_000)["repeats"]
    assert tv > threshold, f"the check did not catch drafts left uncounted (TV {tv:.4f} < {threshold:.4f})"
