"""bench adapt_sim: the chooser in simulated requests, against fixed K rows whose speedup Thm 2 gives exactly."""
import json

import pytest

from benchmarks.bench_adapt_sim import chooser, main, parse_args, simulate
from saguaro.adapt_settings import AdaptSettings
from saguaro.engine.k_schedule import FixedK

ARGS = ["--target", "t", "--draft", "d", "--max-k", "3", "--max-tokens", "24", "--requests", "3"]


def test_a_fixed_k_request_runs_at_thm2s_speed_when_every_draft_is_accepted_or_none_is():
    costs = chooser(parse_args(ARGS), AdaptSettings()).profile
    v, d = costs.verify, costs.draft_step(1)
    # none accepted: one token per round of K draft steps and a K + 1 row verification
    assert simulate(FixedK(2), costs, lambda made: 0.0, 10, 0) == pytest.approx(v(1) / (2 * d + v(3)))
    # all accepted: K + 1 tokens per round (24 tokens: 8 whole rounds at K = 2)
    assert simulate(FixedK(2), costs, lambda made: 1.0, 24, 0) == pytest.approx(3 * v(1) / (2 * d + v(3)))


def test_the_report_names_the_best_fixed_k_and_the_adaptive_rows_ratio(tmp_path):
    assert main([*ARGS, "--acceptances", "0,1", "--variant", "stay_gain=1.0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_adapt_sim.json").read_text())
    assert result["rows"] == ["K=1", "K=2", "K=3", "adaptive", "adaptive stay_gain=1.0"]
    never, always = result["cases"][:2]
    assert never["best_fixed"] == "AR" and all(never["speedup"][f"K={k}"] < 1 for k in (1, 2, 3))
    assert always["best_fixed"] != "AR"
    for case in result["cases"]:
        best = case["speedup"][case["best_fixed"]]
        assert all(r == pytest.approx(case["speedup"][name] / best) for name, r in case["x_best"].items())
    assert "Worst ratio to the best fixed K" in (tmp_path / "bench_adapt_sim.md").read_text()


@pytest.mark.parametrize("bad", [["--acceptances", "1.5"], ["--variant", "stay_gain=2.0"], ["--max-k", "0"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        parse_args([*ARGS, *bad])
