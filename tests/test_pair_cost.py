"""Without a calibration profile, the defaults take a draft step's cost from the pair's weight bytes where that is
below the documented default (``saguaro.calibration.pair_cost``): the 0.5B int4 draft beside the 1.5B bf16 target
costs about a tenth of a verification, not 0.38, and the requests that choose K from the profile alone speculate
accordingly. Only the models' configs are read (no weights)."""
import pytest

from saguaro.adapt.build import _profile
from saguaro.calibration import pair_cost
from saguaro.calibration.profile import DEFAULTS, default_profile
from saguaro.calibration.store import profile_path
from saguaro.config import Config

QWEN = dict(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", dtype="bfloat16")


@pytest.fixture
def no_profiles(tmp_path, monkeypatch):
    """No stored calibration profile (the models still come from the usual cache)."""
    import saguaro.calibration.store as store
    monkeypatch.setattr(store, "cache_root", lambda: tmp_path)
    return tmp_path


def test_the_pair_s_bytes_set_the_draft_cost(no_profiles):
    small = Config(mode="ssd", draft_weights="int4", draft_vocab=65536, **QWEN)
    ratio = pair_cost.draft_ratio(small)
    # 1.5B bf16 streams ~3.1 GB a pass, the int4 0.5B with a 65,536-token head ~0.26 GB
    assert 0.06 < ratio < 0.12
    assert pair_cost.draft_ratio(Config(mode="sd", **QWEN)) == pytest.approx(
        pair_cost.byte_ratio(*_pass_bytes(QWEN["target"], "bf16", QWEN["draft"], "bf16")))
    assert not profile_path(QWEN["target"], QWEN["draft"], "bfloat16").exists()
    profile = _profile(Config(mode="sd", num_speculative_tokens=4, draft_weights="int4", draft_vocab=65536, **QWEN))
    timing = profile.timing
    assert profile.default and timing.draft_rows["1"] / timing.verify_s == pytest.approx(ratio)


def test_the_default_stands_where_the_estimate_is_higher_or_unknown(no_profiles):
    def ratio(**names):
        return pair_cost.draft_ratio(Config(mode="sd", dtype="bfloat16", **names))
    assert ratio(target=QWEN["draft"], draft=QWEN["draft"]) is None  # about 1
    assert ratio(target="no-such-model", draft=QWEN["draft"]) is None
    assert ratio(proposer="ngram", target=QWEN["target"]) is None
    timing = default_profile("t", "d", "bfloat16", 4).timing
    assert timing.draft_rows["1"] / timing.verify_s == pytest.approx(DEFAULTS["draft_ratio"])


def _pass_bytes(target, target_weights, draft, draft_weights):
    from saguaro.backends.cpu_kernels.model import pass_bytes
    from saguaro.loading import load_config
    return pass_bytes(load_config(target), target_weights), pass_bytes(load_config(draft), draft_weights)


def test_a_cheaper_draft_is_given_more_drafts(no_profiles):
    """The K a seeded request chooses from the profile alone (batch 1, Thm 2 with the profile's costs) at a code
    prompt's acceptance of 0.8: more drafts with the pair's byte ratio than with the documented 0.38."""
    import numpy as np

    from saguaro.adapt.costs import LiveCosts
    from saguaro.adapt.speed import BatchCosts, sd_gains
    from saguaro.theory.speedup import expected_tokens
    tokens = np.array([[expected_tokens(0.8, k) for k in range(9)]])

    def best_k(profile):
        return int(np.argmax(sd_gains(tokens, BatchCosts.at(LiveCosts.from_timing(profile.timing), 1, 8))))
    pair = _profile(Config(mode="sd", num_speculative_tokens=8, draft_weights="int4", draft_vocab=65536, **QWEN))
    assert best_k(pair) > best_k(default_profile("t", "d", "bfloat16", 8)) >= 1
