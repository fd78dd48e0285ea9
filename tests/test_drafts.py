"""The draft is resolved once to one kind, and each kind answers for itself (saguaro/drafts.py, build.py)."""
import pytest
import torch

from saguaro import LLM
from saguaro.drafts import ModelDraft, NgramDraft, NoDraft, as_draft, received_draft
from saguaro.eagle.draft import EagleDraft
from tests.eagle_heads import random_head_dir
from tests.tiny import tiny_model, truncated

COMMON = dict(block_size=4, num_speculative_tokens=2, dtype="float32")


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=4)


def test_each_draft_resolves_to_its_kind(target, tmp_path_factory):
    head_dir = random_head_dir(target, tmp_path_factory, "midlayer")
    draft = truncated(target, 1)
    cases = [(dict(), NoDraft), (dict(mode="sd", proposer="ngram", draft=draft), NgramDraft),
             (dict(mode="sd", draft=draft), ModelDraft), (dict(mode="sd", draft=head_dir), EagleDraft),
             (dict(mode="sd", draft=head_dir, draft_kind="eagle3"), EagleDraft)]
    for options, kind in cases:
        with LLM(target, **{**COMMON, **options}) as llm:
            assert type(llm.draft) is kind, options
            if kind is EagleDraft:  # the target's runner taps what the head reads, its whole embedding table
                assert llm.draft.taps == (1, 2, 2) and llm.draft.embed is target.model.model.embed_tokens.weight
            else:
                assert llm.draft.taps == ()
    with pytest.raises(ValueError, match="head's directory"):
        LLM(target, mode="sd", draft=draft, draft_kind="eagle3", **COMMON)


def test_a_shipment_rebuilds_the_draft(target, tmp_path_factory):
    """What a speculator process receives of each kind rebuilds it there: a model by its weights (or its name),
    a head by its directory and what it reads of the target."""
    draft = truncated(target, 1)
    shipped = ModelDraft(draft).shipment()
    try:
        model = received_draft(shipped, "cpu", torch.float32).model.model
    finally:
        shipped.close()
    for name, value in draft.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert as_draft("some-model").shipment().name == "some-model"
    head = EagleDraft(random_head_dir(target, tmp_path_factory, "midlayer"), target.config,
                      target.model.model.embed_tokens.weight)
    shipped = head.shipment()
    try:
        back = received_draft(shipped, "cpu", torch.float32)
    finally:
        shipped.close()
    assert back.head_dir == head.head_dir and back.taps == head.taps and torch.equal(back.embed, head.embed)
