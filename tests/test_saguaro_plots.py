"""benchmarks/plots_saguaro.py: the calibration figure renders from a profile (no decoding needed)."""
import json

from benchmarks.plots_saguaro import main


def test_fanout_figure_from_the_default_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))  # no profile: the documented defaults
    assert main(["--only", "fanout", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "saguaro_fanout_powerlaw.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "saguaro_plots.json").read_text())
    assert data["profile_default"] and data["fanout"]["primary@1.0"]["r"] == 0.6


def test_unknown_figure_is_refused(tmp_path):
    assert main(["--only", "nope", "--out", str(tmp_path)]) == 2


def test_predicted_figure_pairs_runs_and_predicts_the_plan_that_ran(tmp_path):
    """The paired measurement: per repeat and group AR, SD, then each SSD configuration, back to back; a
    point's measured speedup is the median of the per-repeat ratios; the prediction uses the run's plan."""
    import argparse

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import predicted
    from saguaro.calibration.profile import default_profile

    calls = []
    speeds = {"ar": [10.0, 5.0], "sd": [20.0, 10.0], "ssd": [30.0, 16.0]}  # repeat 2 is a slow spell

    def fake_run(args, mode, prompts, temperature=0.0, batch=1, **options):
        calls.append((mode, temperature, batch, options))
        repeat = sum(c[0] == "ar" for c in calls) - 1
        row = {"mode": mode, "temperature": temperature, "batch": batch, "tok_s": speeds[mode][repeat], **options}
        if mode == "ssd":
            row.update(p_hit=0.8, plan_primary=[1, 1, 1, 1, 2], plan_backup=[1, 1, 1, 1, 2], plan_c=1.0,
                       plan_branch_steps=options.get("branch_steps"), plan_deep=1)
        return row

    args = argparse.Namespace(repeats=2, predict_groups="0:1", predict_configs="last2@2", k=4)
    rows = predicted.measure(fake_run, args, [[1, 2, 3]])
    assert [c[0] for c in calls] == ["ar", "sd", "ssd"] * 2
    assert calls[2][3] == {"fan_out": [1, 1, 1, 1, 2], "branch_steps": 2}
    pts = predicted.points(args, rows, default_profile("t", "d", "bfloat16", 4))
    ssd = next(p for p in pts if p["config"] == "SSD last2@2")
    assert ssd["measured"]["all"] == [3.0, 3.2] and ssd["measured"]["median"] == 3.1
    assert ssd["measured_vs_sd"]["all"] == [1.5, 1.6]
    assert ssd["predicted"] > 1 and abs(ssd["error"] - (ssd["predicted"] / 3.1 - 1)) < 1e-12
    assert ssd["plan"]["plan_branch_steps"] == 2
    sd = next(p for p in pts if p["config"] == "SD")
    assert sd["measured"]["median"] == 2.0 and sd["predicted_vs_sd"] == 1.0
    assert "within 10%" in predicted.table(pts)
    predicted.figure(pts, tmp_path, plt)
    assert (tmp_path / "saguaro_predicted_vs_measured.png").stat().st_size > 10_000


def test_predicted_groups_and_fan_out_specs():
    from benchmarks.common import parse_fan_out
    from benchmarks.predicted import parse_groups
    assert parse_groups("0:1; 1:4;0.5") == [(0.0, 1), (1.0, 4), (0.5, 1)]
    assert parse_fan_out("auto@auto", 3) == ("auto", "auto")
    assert parse_fan_out("last3@2", 3) == ([1, 1, 1, 3], 2)
    assert parse_fan_out("uniform", 2) == ([1, 1, 1], None)
    assert parse_fan_out("2,0,1", 2) == ([2, 0, 1], None)
