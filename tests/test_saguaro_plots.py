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
