"""Config validates and only validates; the removed spellings are refused with what replaced them."""
import pytest

from saguaro import LLM
from saguaro.config import Config


@pytest.mark.parametrize("removed, options, replacement", [
    ("compile", dict(compile=False), "enforce_eager=True"), ("compile", dict(compile=True), "enforce_eager"),
    ("speculator", dict(mode="sd", speculator="ngram"), "proposer="),
    ("fallback", dict(draft="d", mode="ssd", fallback="random"), "miss_strategy="),
])
def test_removed_spellings_name_their_replacement(removed, options, replacement):
    """compile=, speculator= and fallback= warned for a release; now they are refused, naming what replaced them."""
    with pytest.raises(TypeError, match=f"{removed}= was removed: .*{replacement}"):
        Config("t", **options)
    with pytest.raises(TypeError, match=f"{removed}= was removed"):
        LLM("t", **options)  # refused before anything loads
    assert Config("t", mode="sd", proposer="ngram").proposer == "ngram"
    assert Config("t", draft="d", mode="ssd", miss_strategy="random").ssd.miss_strategy == "random"


def test_bad_proposer_and_a_missing_draft_are_refused():
    with pytest.raises(ValueError, match="proposer must be one of"):
        Config("t", mode="sd", proposer="oracle")
    with pytest.raises(ValueError, match="needs a draft model"):
        Config("t", mode="sd")
