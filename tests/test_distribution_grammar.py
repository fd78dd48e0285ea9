"""Grammar-constrained sampling at temperature 1 through SD and SSD is exactly constrained sampling from the target.

The grammar is a tiny JSON schema (an enum of short strings), so its language has a handful of token sequences on
the byte-level tiny model; the exact law of each is computed by walking the grammar token by token, with the
target's masked, renormalized distribution at every step (one full forward per prefix). Seeded requests through
the engine are compared with that law by total variation (threshold: tests/stats.py). The draft is the target's
1-layer truncation and samples unconstrained, so its proposals often break the grammar. Negative control: the
same samples are far from the law the draft's own distribution would give under the grammar.
"""
import json

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.sampling.grammar import JsonGrammar
from tests.processor_reference import prefix_logits
from tests.stats import empirical, tv_distance, tv_threshold
from tests.tiny import byte_level_model, truncated

SCHEMA = json.dumps({"enum": ["a", "b", "ab", "ba", "Hello"]})


@pytest.fixture(scope="module")
def pair():
    target = byte_level_model(seed=4)
    return target, truncated(target, 1)


def _params(target, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, stop_token_ids=[target.config.vocab_size - 1],
                          grammar=JsonGrammar(SCHEMA))


@torch.no_grad()
def constrained_law(model, grammar_of, prompt: list[int], stop: int) -> dict[tuple[int, ...], float]:
    """Every complete output (ending on ``stop``) and its probability under ``model`` masked by the grammar."""
    import xgrammar as xgr
    state = grammar_of.state(JsonGrammar(SCHEMA), [stop])
    vocab = model.config.vocab_size
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], mass: float) -> None:
        row = prefix_logits(model, [prompt + prefix])[0, -1].float().clone()[None]
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        state.matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=vocab)
        probs = torch.softmax(row[0].double(), dim=-1)
        for token in torch.nonzero(probs).flatten().tolist():
            if token == stop:
                law[tuple(prefix + [token])] = mass * float(probs[token])
                continue
            assert state.matcher.accept_token(token)
            walk(prefix + [token], mass * float(probs[token]))
            state.matcher.rollback(1)

    walk([], 1.0)
    return law


def _measure(make, pair, n: int) -> tuple[float, float, float]:
    """(TV to the target's constrained law, TV to the draft's, threshold) for n samples through ``make``."""
    target, draft = pair
    prompt = target.tokenizer.encode("Hello world")
    stop = target.config.vocab_size - 1
    with make(pair) as llm:
        outs = llm.generate([prompt] * n, [_params(target, i) for i in range(n)])
        grammars = llm.engine.grammars
        assert getattr(llm.engine.decoder, "failure", None) is None
    accepted = sum(o.spec.accepted_tokens for o in outs)
    assert 0 < accepted < sum(o.spec.drafted_tokens for o in outs)  # rows after accepted drafts are sampled too
    laws = [constrained_law(m, grammars, prompt, stop) for m in (target, draft)]
    support = sorted(set(laws[0]) | set(laws[1]))
    index = {seq: i for i, seq in enumerate(support)}
    assert all(tuple(o.token_ids) in laws[0] for o in outs), "an output outside the grammar's language"
    p_hat = empirical(torch.tensor([index[tuple(o.token_ids)] for o in outs]), len(support))
    tvs = [tv_distance(p_hat, torch.tensor([law.get(s, 0.0) for s in support], dtype=torch.float64))
           for law in laws]
    return tvs[0], tvs[1], tv_threshold(n, len(laws[0]))


def _sd(pair):  # a fixed K (not adaptive), so that every round drafts and rows after drafts are sampled
    return LLM(target=pair[0], draft=pair[1], mode="sd", num_speculative_tokens=3, adaptive=False, block_size=4,
               max_num_seqs=512, kv_cache_tokens=512 * 24)


def _ssd(pair):
    return LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, fan_out=[1, 1, 1, 2],
               adaptive=False, block_size=4, max_num_seqs=512, kv_cache_tokens=512 * 24)


@pytest.mark.parametrize("make, n", [(_sd, 12_000), (_ssd, 8_000)], ids=["sd", "ssd"])
def test_constrained_law(pair, make, n):
    tv_target, tv_draft, threshold = _measure(make, pair, n)
    assert tv_target < threshold, (tv_target, threshold)
    assert tv_draft > threshold, (tv_draft, threshold)  # negative control: the draft's law fails the same test
