"""Without a calibration profile, the defaults take a draft step's cost from the pair's weight bytes where that is
below the documented default (``saguaro.calibration.pair_cost``): the 0.5B int4 draft beside the 1.5B bf16 target
costs about a tenth of a target step, not 0.38, and the requests that choose K from the profile alone speculate
accordingly; and what more rows cost each model from the kernels' GEMM row curves (``row_costs``), measured once
per CPU and kept. Only the models' configs are read (no weights)."""
import pytest

from saguaro.adapt.build import _profile
from saguaro.calibration import pair_cost
from saguaro.calibration.profile import DEFAULTS, PairCosts, default_profile
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
    ratio = pair_cost.pair_costs(small).draft_ratio
    # 1.5B bf16 streams ~3.1 GB a pass, the int4 0.5B with a 65,536-token head ~0.26 GB
    assert 0.06 < ratio < 0.12
    assert pair_cost.pair_costs(Config(mode="sd", **QWEN)).draft_ratio == pytest.approx(
        pair_cost.byte_ratio(*_pass_bytes(QWEN["target"], "bf16", QWEN["draft"], "bf16")))
    assert not profile_path(QWEN["target"], QWEN["draft"], "bfloat16").exists()
    profile = _profile(Config(mode="sd", num_speculative_tokens=4, draft_weights="int4", draft_vocab=65536, **QWEN))
    timing = profile.timing
    assert profile.default and timing.draft_rows["1"] / timing.target_rows["1"] == pytest.approx(ratio)


def test_the_default_stands_where_the_estimate_is_higher_or_unknown(no_profiles):
    def ratio(**names):
        return pair_cost.pair_costs(Config(mode="sd", dtype="bfloat16", **names)).draft_ratio
    assert ratio(target=QWEN["draft"], draft=QWEN["draft"]) is None  # about 1
    assert ratio(target="no-such-model", draft=QWEN["draft"]) is None
    assert ratio(proposer="ngram", target=QWEN["target"]) is None
    timing = default_profile("t", "d", "bfloat16", 4).timing
    assert timing.draft_rows["1"] / timing.verify_s == pytest.approx(DEFAULTS["draft_ratio"])


def _pass_bytes(target, target_weights, draft, draft_weights):
    from saguaro.backends.cpu_kernels.model import pass_bytes
    from saguaro.loading import load_config
    return pass_bytes(load_config(target), target_weights), pass_bytes(load_config(draft), draft_weights)


def test_a_cheaper_draft_is_given_more_drafts(no_profiles, monkeypatch):
    """The K a seeded request chooses from the profile alone (batch 1, Thm 2 with the profile's costs) at a code
    prompt's acceptance of 0.8: more drafts with the pair's byte ratio than with the documented 0.38 (rows as
    nearly free as the documented slopes say, whatever this CPU's kernels measure)."""
    import numpy as np

    from saguaro.adapt.costs import LiveCosts
    from saguaro.adapt.speed import BatchCosts, sd_gains
    from saguaro.backends.cpu_kernels import row_costs
    from saguaro.theory.speedup import expected_tokens
    monkeypatch.setattr(row_costs, "curve", lambda ops, weights, rows: {n: 1 + 0.02 * (n - 1) for n in rows})
    tokens = np.array([[expected_tokens(0.8, k) for k in range(9)]])

    def best_k(profile):
        return int(np.argmax(sd_gains(tokens, BatchCosts.at(LiveCosts.from_timing(profile.timing), 1, 8))))
    pair = _profile(Config(mode="sd", num_speculative_tokens=8, draft_weights="int4", draft_vocab=65536, **QWEN))
    assert best_k(pair) > best_k(default_profile("t", "d", "bfloat16", 8)) >= 1


def test_the_row_curves_follow_the_kernels(no_profiles, monkeypatch):
    """Each model's pass over n rows: its weights' share follows the kernels' GEMM curve for its format (here a
    steep int4 one), the overhead's share stays flat; the verification of K + 1 rows is the profile's unit,
    and a draft step is the byte ratio of a 1-row target step. The eager reference, fp32 and a GPU keep the
    documented slopes."""
    from saguaro.backends.cpu_kernels import row_costs
    from saguaro.calibration.profile import ROW_GRID
    gemm = {"int4": {n: 1 + 0.3 * (n - 1) for n in ROW_GRID}}
    monkeypatch.setattr(row_costs, "curve", lambda ops, weights, rows: {n: gemm[weights][n] for n in rows})
    cfg = Config(mode="sd", num_speculative_tokens=4, target_weights="int4", draft_weights="int4", draft_vocab=8192,
                 **QWEN)
    costs = pair_cost.pair_costs(cfg)
    from saguaro.backends.cpu_kernels.model import pass_bytes
    from saguaro.loading import load_config
    target_bytes = pass_bytes(load_config(QWEN["target"]), "int4")
    draft_bytes = pass_bytes(load_config(QWEN["draft"]), "int4", 8192)
    assert costs.target_rows == pytest.approx(pair_cost.pass_curve(target_bytes, gemm["int4"]))
    assert costs.draft_rows == pytest.approx(pair_cost.pass_curve(draft_bytes, gemm["int4"]))
    assert costs.draft_ratio == pytest.approx(pair_cost.byte_ratio(target_bytes, draft_bytes))
    share = target_bytes / (target_bytes + pair_cost.PASS_OVERHEAD_BYTES)
    assert 0.9 < share < 1 and costs.target_rows[5] == pytest.approx(1 + share * 1.2)
    timing = _profile(cfg).timing
    assert timing.verify_s == 1.0 and timing.target_rows["5"] == pytest.approx(1.0)
    assert timing.target_rows["1"] == pytest.approx(1 / costs.target_rows[5])
    assert timing.draft_rows["1"] / timing.target_rows["1"] == pytest.approx(costs.draft_ratio)
    ngram = pair_cost.pair_costs(Config(mode="sd", proposer="ngram", target=QWEN["target"], dtype="bfloat16",
                                        target_weights="int4"))
    assert ngram.target_rows == costs.target_rows and ngram.draft_rows is None and ngram.draft_ratio is None
    for flat in (dict(enforce_eager=True), dict(dtype="float32")):
        assert pair_cost.pair_costs(Config(mode="sd", **{**QWEN, **flat})).target_rows is None
    on_gpu = Config(mode="sd", **QWEN)
    on_gpu.device = "cuda:0"  # (no GPU here to validate one against)
    assert pair_cost.pair_costs(on_gpu) == PairCosts()


def test_a_steep_verification_is_given_fewer_drafts(no_profiles, monkeypatch):
    """The K a seeded request chooses from the profile alone at an acceptance of 0.8 (3 with free rows): fewer drafts
    where the target's extra rows cost what int4 verification costs (the kernels' curve) than where they are
    nearly free."""
    import numpy as np

    from saguaro.adapt.costs import LiveCosts
    from saguaro.adapt.speed import BatchCosts, sd_gains
    from saguaro.backends.cpu_kernels import row_costs
    from saguaro.calibration.profile import ROW_GRID
    from saguaro.theory.speedup import expected_tokens
    tokens = np.array([[expected_tokens(0.8, k) for k in range(9)]])
    steep = {n: 1 + 0.3 * (n - 1) for n in ROW_GRID}
    cfg = Config(mode="sd", num_speculative_tokens=8, target_weights="int4", draft_weights="int4", draft_vocab=65536,
                 **QWEN)

    def best_k(curve):
        monkeypatch.setattr(row_costs, "curve", lambda ops, weights, rows: {n: curve[n] for n in rows})
        costs = LiveCosts.from_timing(_profile(cfg).timing)
        return int(np.argmax(sd_gains(tokens, BatchCosts.at(costs, 1, 8))))
    assert best_k(steep) < best_k({n: 1.0 for n in ROW_GRID})


def test_the_gemm_curve_is_measured_once_per_cpu_then_kept(tmp_path, monkeypatch):
    from saguaro.backends.cpu_kernels import build, kept, row_costs
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    ops = build.load("portable")
    curve = row_costs.curve(ops, "int4", (1, 2, 4))
    assert curve[1] == 1.0 and curve[1] <= curve[2] <= curve[4]
    key = row_costs.curve_key(ops, "int4")
    assert key.startswith(f"{kept.cpu_identity()} | portable | ") and build.source_digest() in key
    assert kept.read(row_costs.FILE) == {key: {"1": 1.0, "2": curve[2], "4": curve[4]}}
    monkeypatch.setattr(row_costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert row_costs.curve(ops, "int4", (2, 4)) == {2: curve[2], 4: curve[4]}
    monkeypatch.setattr(build, "source_digest", lambda: "changed kernels")  # another build's curve is its own
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        row_costs.curve(ops, "int4", (2, 4))
    monkeypatch.undo()
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    (tmp_path / "cpu" / row_costs.FILE).write_text("{not json")  # a broken file is measured again
    assert row_costs.curve(ops, "int4", (1, 2))[1] == 1.0
    # two processes measuring at once: the first to keep its curve wins, and the other uses that one (a seeded
    # request's K must not differ between them)
    first = {"1": 1.0, "2": 9.0}

    def racing(ops, weights, rows):
        kept.keep(row_costs.FILE, row_costs.curve_key(ops, "int8"), first)  # kept meanwhile
        return {1: 1.0, 2: 1.5}
    monkeypatch.setattr(row_costs, "measure", racing)
    assert row_costs.curve(ops, "int8", (1, 2)) == {1: 1.0, 2: 9.0}
