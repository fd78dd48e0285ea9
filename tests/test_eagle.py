"""EAGLE-3 heads: loading each public layout, the target's features, and SD greedy equal to AR (fp32)."""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.eagle.checkpoint import EagleCheckpointError, load_eagle3
from saguaro.eagle.head import load_head
from saguaro.engine.model_runner import ForwardItem, ModelRunner
from tests.eagle_heads import random_head_dir, random_head_state, write_head
from tests.tiny import PROMPTS, greedy_tokens, tiny_model

LAYOUTS = ["midlayer", "hf", "speculators"]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=4, sharpness=3.0)


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    return random_head_dir(target, tmp_path_factory, "midlayer", draft_vocab=48, seed=1)


@pytest.fixture(scope="module")
def ar_outputs(target):
    return greedy_tokens(target, PROMPTS, 24)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("own_embed", [False, True], ids=["shared-embed", "own-embed"])
def test_each_layout_loads_the_same_head(target, tmp_path, layout, own_embed):
    cfg, state = random_head_state(target, draft_vocab=40, seed=2, own_embed=own_embed)
    _, normalized, found = load_eagle3(write_head(tmp_path, cfg, state, layout))
    assert found == layout
    head = load_head(str(tmp_path), target.model)
    for name, value in state.items():
        assert torch.equal(head.state_dict()[name], value), name
    # the vocabulary maps: draft id i is target id i + d2t[i]; t2d marks exactly those ids
    ids = head.draft_ids
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 40
    assert head.t2d.sum() == 40 and head.t2d[ids].all()
    assert head.shared_embed is not None or own_embed


def test_bad_heads_are_refused(target, tmp_path):
    with pytest.raises(EagleCheckpointError, match="no config.json"):
        load_eagle3(tmp_path)
    cfg, state = random_head_state(target, draft_vocab=40)
    state.pop("layer.mlp.up_proj.weight")
    write_head(tmp_path, cfg, state, "speculators")
    with pytest.raises(EagleCheckpointError, match="missing"):
        load_head(str(tmp_path), target.model)
    other = tiny_model(seed=0, vocab=32, layers=4)
    cfg, state = random_head_state(other)
    write_head(tmp_path / "other", cfg, state, "hf")
    with pytest.raises(EagleCheckpointError, match="vocabulary"):
        load_head(str(tmp_path / "other"), target.model)


def test_taps_keep_the_tapped_layers_inputs(target):
    """The tapped features are the residual stream entering each tapped layer, in tap order."""
    seen = []
    runner = ModelRunner(target.model, 8, 4)
    captured = {}
    hooks = [target.model.model.layers[i].register_forward_pre_hook(
        lambda m, args, i=i: captured.__setitem__(i, args[0].clone())) for i in (1, 3)]
    try:
        runner.tap([3, 1], lambda items, features: seen.append(features))
        table = []
        runner.blocks.reserve(table, 5)
        runner.forward([ForwardItem([1, 2, 3, 4, 5], 0, table, "all")])
    finally:
        for h in hooks:
            h.remove()
        target.model.taps = ()
    assert torch.equal(seen[0], torch.cat([captured[3], captured[1]], -1))


@pytest.mark.parametrize("k, chunk", [(1, 4096), (3, 4096), (3, 3)])
def test_greedy_eagle_sd_equals_ar(target, head_dir, ar_outputs, k, chunk):
    """chunk 3: every prompt is prefilled in chunks of 3 tokens, the head taking the features chunk by chunk."""
    with LLM(target=target, draft=str(head_dir), mode="sd", num_speculative_tokens=k, block_size=4,
             max_prefill_tokens=chunk) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
        assert [o.token_ids for o in outs] == ar_outputs
        spec = llm.spec_metrics(outs)
        assert spec.drafted_tokens > 0
        proposer = llm.engine.decoder.proposer
        assert proposer.blocks.num_free == proposer.blocks.num_blocks  # every head block back


def test_reduced_vocabulary_drafts_stay_inside_it(target, tmp_path):
    """A head over 8 of the 64 ids proposes only those, and its distributions put no mass elsewhere."""
    cfg, state = random_head_state(target, draft_vocab=8, seed=4)
    write_head(tmp_path, cfg, state, "hf")
    with LLM(target=target, draft=str(tmp_path), draft_kind="eagle3", mode="sd", num_speculative_tokens=3,
             block_size=4) as llm:
        allowed = set(llm.engine.decoder.proposer.head.draft_ids.tolist())
        seqs = [llm.engine.add_request(p, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
                for i, p in enumerate(PROMPTS)]
        llm.engine.step()  # prefill
        proposal = llm.engine.decoder.proposer.propose(seqs, [3] * len(seqs))
        assert all(t in allowed for row in proposal.tokens for t in row)
        support = proposal.probs.sum(dim=(0, 1)) > 0
        assert set(torch.nonzero(support).flatten().tolist()) <= allowed


@pytest.mark.parametrize("options, message", [
    (dict(mode="ar", draft_kind="eagle3"), "mode='sd' or mode='ssd'"),
    (dict(mode="sd", proposer="ngram", draft_kind="eagle3"), "proposer='ngram'"),
    (dict(mode="ssd", draft_weights="int8"), "draft model's weights"),
])
def test_eagle_draft_refuses_what_it_cannot_do(target, head_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(target=target, draft=str(head_dir), block_size=4, **options)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_eagle_draft_under_tensor_parallelism(target, head_dir, ar_outputs, mode):
    """A target sharded over 2 ranks (spawned processes, Gloo), an EAGLE-3 head drafting: greedy equals AR in
    fp32. The residual stream is all-reduced, whole on every rank, so rank 0 taps it; the head reads the whole
    embedding table, of which rank 0 holds a vocabulary shard. SSD ships both to its speculator process."""
    with LLM(target=target, draft=str(head_dir), mode=mode, num_speculative_tokens=3, block_size=4,
             dtype="float32", tensor_parallel_size=2, adaptive=False) as llm:  # a fixed K: drafts every round
        assert llm.engine.target.cache.data.shape[3] == 1  # each rank holds one of the 2 KV heads
        assert llm.draft.embed.shape[0] == target.config.vocab_size
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
        metrics = llm.spec_metrics(outs)
        assert getattr(llm.engine.decoder, "failure", None) is None
    assert [o.token_ids for o in outs] == ar_outputs
    assert metrics.drafted_tokens > 0 and metrics.accepted_tokens > 0


def test_preempted_requests_still_equal_ar(target, head_dir, ar_outputs):
    """A KV cache too small for every request at once: preempted requests re-prefill, and the head takes the
    target's features again from the new prefill."""
    with LLM(target=target, draft=str(head_dir), mode="sd", num_speculative_tokens=3, block_size=4,
             kv_cache_tokens=96) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
        assert [o.token_ids for o in outs] == ar_outputs
