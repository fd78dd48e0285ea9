"""The SSD benchmark's plan: SD at several K on one core, and ratios against the fastest of them.

No models run here; the benchmark itself is not a test (timings are noisy on shared machines).
"""
import pytest

from benchmarks.bench_ssd import fastest_sd_bases, parse_args, plan
from benchmarks.common import ALL


def test_sd_k_list_runs_each_k_and_keeps_the_reference_at_ssd_k():
    p = plan(parse_args(["--k", "3", "--sd-k", "5,7", "--fan-outs", "last2", "--skip-two-threads"]))
    names = [name for name, _ in p["configs"]]
    assert names == ["AR (1 core)", "SD K=5 (1 core)", "SD K=7 (1 core)", "SD K=3 (1 core)",
                     "SSD K=3 F=[1,1,1,2] (2 cores)"]
    assert p["sd_one"] == ["SD K=5 (1 core)", "SD K=7 (1 core)", "SD K=3 (1 core)"]
    assert p["names"]["sd_ref"] == "SD K=3 (1 core)"  # same rows as SSD's verification
    opts = dict(p["configs"])
    assert opts["SD K=7 (1 core)"]["num_speculative_tokens"] == 7


def test_default_sd_k_is_ssd_k():
    p = plan(parse_args(["--k", "4", "--fan-outs", "uniform", "--skip-two-threads"]))
    assert p["sd_one"] == ["SD K=4 (1 core)"] and p["names"]["sd_ref"] == "SD K=4 (1 core)"
    assert [name for name, _ in p["configs"]].count("SD K=4 (1 core)") == 1


def test_ratios_are_against_the_fastest_sd_per_temperature():
    p = plan(parse_args(["--k", "3", "--sd-k", "5,7", "--fan-outs", "last2", "--skip-two-threads"]))

    def summary(t0, t1):
        return {"T=0": {ALL: {"tok_s_median": t0}}, "T=1": {ALL: {"tok_s_median": t1}}}
    summaries = {"AR (1 core)": summary(10, 10), "SD K=5 (1 core)": summary(20, 18),
                 "SD K=7 (1 core)": summary(22, 16), "SD K=3 (1 core)": summary(15, 19)}
    bases = fastest_sd_bases(p, summaries)
    assert bases["T=0"]["sd1"] is summaries["SD K=7 (1 core)"]
    assert bases["T=1"]["sd1"] is summaries["SD K=3 (1 core)"]  # the reference at SSD's K competes too


def test_fan_outs_of_their_own_k_and_tapered_trees():
    p = plan(parse_args(["--k", "4", "--sd-k", "5", "--fan-outs", "1,1,1,2;1,1,1,1,2@2", "--deep-branches", "2",
                         "--skip-two-threads"]))
    opts = dict(p["configs"])
    plain, tapered = "SSD K=3 F=[1,1,1,2] (2 cores)", "SSD K=4 F=[1,1,1,1,2], tapered 2+2 (2 cores)"
    assert p["ssd"] == [plain, tapered] and p["ssd_k"] == {plain: 3, tapered: 4}
    assert opts[plain]["num_speculative_tokens"] == 3 and opts[plain]["branch_steps"] is None
    assert opts[tapered]["branch_steps"] == 2 and opts[tapered]["deep_branches"] == 2


def test_each_saguaro_c_is_its_own_ssd_run():
    p = plan(parse_args(["--k", "4", "--sd-k", "5", "--fan-outs", "1,1,1,1,2@2", "--saguaro-c", "1,0.5",
                         "--skip-two-threads"]))
    opts = dict(p["configs"])
    assert [opts[n]["saguaro_c"] for n in p["ssd"]] == [1.0, 0.5]
    assert p["ssd"][1] == "SSD K=4 F=[1,1,1,1,2], tapered 2+1, C=0.5 (2 cores)"


def test_bus_ceiling_per_ssd_configuration_from_sd_at_its_k():
    """Each SSD configuration gets E_SD(K) / max(T_v, (W_t + (K+1) W_d) / B_2) from the SD run at its own K;
    a K without an SD run gets no row."""
    from benchmarks.ceiling import ceiling_rows, ceiling_section
    p = plan(parse_args(["--k", "4", "--sd-k", "5", "--fan-outs", "1,1,1,1,2@2;1,1,2", "--skip-two-threads"]))
    sd4 = {"T=0": {ALL: {"tok_s_median": 26.0, "tokens_per_round": 4.4, "verify_ms_median": 110.0}}}
    sd5 = {"T=0": {ALL: {"tok_s_median": 28.0, "tokens_per_round": 4.8, "verify_ms_median": 120.0}}}
    ssd = {"T=0": {ALL: {"tok_s_median": 30.0}}}
    summaries = {"SD K=4 (1 core)": sd4, "SD K=5 (1 core)": sd5, p["ssd"][0]: ssd, p["ssd"][1]: ssd}
    contention = {"target_pass_bytes": 3.0e9, "draft_pass_bytes": 0.25e9, "busy": [{"bus_bytes_per_s": 35e9}]}
    bus = {"bus_alone": 30e9, "bus_total": 36e9}
    rows = ceiling_rows(p, summaries, contention, bus, {"T=0": {ALL: 28.0}})
    assert [(r["config"], r["group"]) for r in rows] == [(p["ssd"][0], ALL)]  # no SD run at K=2
    r = rows[0]
    floor = (3.0 + 5 * 0.25) / 36  # bus-limited: above T_v = 0.110 s
    assert r["bus_limited"] and r["floor_ms"] == pytest.approx(1e3 * floor)
    assert r["ceiling_tok_s"] == pytest.approx(4.4 / floor)
    assert r["ceiling_x_sd"] == pytest.approx(4.4 / floor / 28.0)
    assert r["measured_of_ceiling"] == pytest.approx(30.0 / (4.4 / floor))
    assert r["bus_cap"] == pytest.approx(((3.0 + 4 * 0.25) / 30) / max(3.0 / 30, (3.0 + 5 * 0.25) / 36))
    assert any("B_2/B_1 = 1.20" in line for line in ceiling_section(rows, contention, bus))


def test_each_transport_runs_every_ssd_configuration_and_a_table_compares_them():
    from benchmarks.bench_ssd import transport_comparison
    p = plan(parse_args(["--k", "3", "--fan-outs", "last2", "--transport", "process,thread", "--skip-two-threads"]))
    process, thread = "SSD K=3 F=[1,1,1,2] (2 cores)", "SSD K=3 F=[1,1,1,2] (thread, 2 cores)"
    opts = dict(p["configs"])
    assert p["ssd"] == [process, thread]
    assert (opts[process]["speculator_transport"], opts[thread]["speculator_transport"]) == ("process", "thread")
    summaries = {process: {"T=0": {ALL: {"tok_s_median": 20.0, "p_hit": 0.8}}},
                 thread: {"T=0": {ALL: {"tok_s_median": 15.0, "p_hit": 0.8}}}}
    lines, payload = transport_comparison(p, summaries)
    assert payload["SSD K=3 F=[1,1,1,2]"]["T=0"]["thread"]["tok_s_median"] == 15.0
    assert any("| 0.75" in line for line in lines)  # thread / process
    alone = plan(parse_args(["--k", "3", "--fan-outs", "last2", "--skip-two-threads"]))
    assert alone["ssd"] == [process] and transport_comparison(alone, {process: summaries[process]}) == ([], {})
    with pytest.raises(SystemExit):
        parse_args(["--transport", "nccl"])
