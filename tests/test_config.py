"""Config validates and only validates; the deprecated spellings still work and say what replaced them."""
import pytest

from saguaro.config import Config


def test_compile_is_a_deprecated_alias_of_enforce_eager():
    with pytest.warns(DeprecationWarning, match="enforce_eager"):
        assert Config("t", compile=False).enforce_eager is True
    with pytest.warns(DeprecationWarning):
        cfg = Config("t", compile=True)
    assert cfg.enforce_eager is False and cfg.compile is None


def test_speculator_is_a_deprecated_alias_of_proposer():
    with pytest.warns(DeprecationWarning, match="proposer"):
        cfg = Config("t", mode="sd", speculator="ngram")
    assert cfg.proposer == "ngram" and cfg.speculator is None
    assert Config("t", mode="sd", proposer="ngram").proposer == "ngram"


def test_bad_proposer_and_a_missing_draft_are_refused():
    with pytest.raises(ValueError, match="proposer must be one of"):
        Config("t", mode="sd", proposer="oracle")
    with pytest.raises(ValueError, match="needs a draft model"):
        Config("t", mode="sd")
