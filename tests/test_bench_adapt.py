"""saguaro bench adapt: its batches, its after-the-fact best fixed row, and one end-to-end run on SmolLM2-135M."""
import json
import subprocess
import sys

import pytest

from benchmarks import bench_adapt as ba
from benchmarks.chooser_prices import RoundPrice, as_dicts, price_table, round_prices
from benchmarks.rounds import SSDRounds
from benchmarks.common import Prompt
from saguaro.adapt_settings import TREE_OPTIONS


def _prompts():
    return [Prompt(d, i, "", [1, 2]) for d in ("humaneval", "mtbench") for i in range(3)]


def test_batches_hold_one_dataset_and_the_mixed_one_all():
    got = ba.batches(_prompts(), 2, mixed=True)
    assert [(name, len(b)) for name, b in got] == [("humaneval", 2), ("humaneval", 1), ("mtbench", 2),
                                                   ("mtbench", 1), (ba.MIXED, 6)]
    assert all({p.dataset for p in b} == {name} for name, b in got[:-1])


def test_best_fixed_is_chosen_after_the_fact_and_the_adaptive_rows_compared():
    names = ["AR", "SD K=2", "SD adaptive K<=5"]
    runs = [{"config": c, "dataset": "mtbench", "temperature": 0.0, "batch": 1, "tok_s": s}
            for c, s in [("AR", 10.0), ("SD K=2", 8.0), ("SD K=2", 9.0), ("SD adaptive K<=5", 11.0)]]
    cell, = ba.summarize(runs, names)
    assert cell["best_fixed"] == "AR"  # AR beats SD here: it is the fixed configuration to match
    assert cell["tok_s"]["SD K=2"] == 8.5
    assert cell["SD adaptive K<=5 x best fixed"] == pytest.approx(1.1) == cell["SD adaptive K<=5 x AR"]


def test_the_adaptive_rows_are_also_compared_on_every_token_over_the_wall_time():
    """Prefill in: what a batch waits for all its requests, beside the chosen rate."""
    names = ["AR", "SD adaptive K<=5"]
    runs = [{"config": c, "dataset": "mtbench", "temperature": 1.0, "batch": 8, "tok_s": s, "total_tok_s": t}
            for c, s, t in [("AR", 10.0, 5.0), ("SD adaptive K<=5", 12.0, 4.0)]]
    cell, = ba.summarize(runs, names)
    assert cell["SD adaptive K<=5 x AR"] == pytest.approx(1.2)
    assert cell["SD adaptive K<=5 x AR total"] == pytest.approx(0.8)


def test_unseeded_sampled_requests_carry_no_seed():
    """``--unseeded``: as a server's requests, each prices its K from the batch's measured costs; greedy ones never
    carry a seed, and by default sampled prompt i carries seed + i."""
    from types import SimpleNamespace
    seen = []

    class Engine:
        def generate(self, ids, params):
            seen.append([p.seed for p in params])
            return [SimpleNamespace(token_ids=[1, 2], timings=SimpleNamespace(ttft_s=0.0), spec=None) for _ in ids]

    batch = _prompts()[:2]
    for argv in ([], ["--unseeded"]):
        args = ba.parse_args(["--modes", "sd", "--seed", "100"] + argv)
        for t in (0.0, 1.0):
            ba.measure("AR", Engine(), (t, 2, "humaneval", batch), args)
    assert seen == [[None, None], [100, 101], [None, None], [None, None]]


def test_ssd_gets_a_row_that_chooses_trees_and_the_branches_per_build():
    args = ba.parse_args(["--modes", "ssd", "--ks", "2", "--max-k", "3"])
    rows = dict(ba.configs(args))
    assert list(rows) == ["AR", "SSD K=2", "SSD adaptive K<=3", "SSD adaptive K<=3 trees"]
    assert rows["SSD adaptive K<=3 trees"]["adapt"] == TREE_OPTIONS and "adapt" not in rows["SSD adaptive K<=3"]
    runs = [{"config": "SSD adaptive K<=3", "dataset": "mtbench", "temperature": 0.0, "batch": 1, "tok_s": 5.0,
             "fan_out_per_round": [[4, 0, 2], [8]]}]
    cell, = ba.summarize(runs, ["SSD adaptive K<=3"])
    assert cell["mean_fan_out"]["SSD adaptive K<=3"] == pytest.approx(14 / 3)  # rounds at K = 0 build nothing


def test_greedy_outputs_are_compared_prompt_by_prompt():
    """Two batches of one dataset: each speculative output is compared with AR's for the same prompt."""
    def run(config, prompt, ids):
        return {"config": config, "temperature": 0, "datasets": ["mtbench"], "prompts": [prompt], "token_ids": [ids],
                "batch": None}
    runs = [run("AR", 0, [1, 2]), run("AR", 1, [3, 4]), run("SD K=2", 0, [1, 2]), run("SD K=2", 1, [3, 4]),
            run("SSD K=2", 0, [1, 2]), run("SSD K=2", 1, [3, 5])]
    assert ba.greedy_equal(runs) == (3, 4)
    assert ba.greedy_unequal(runs) == [{"config": "SSD K=2", "dataset": "mtbench", "prompt": 1, "batch": None,
                                        "first_difference": 1}]


def test_every_batch_runs_through_every_row_in_turn(monkeypatch):
    """Interleaved (the default): every engine open at once, each batch through all rows, the order rotated per
    batch, so that the rows meet the same load; ``--sequential``: a row's batches together, one engine open."""
    from types import SimpleNamespace
    opened, log = [], []

    class Engine:
        def __init__(self, name):
            self.name, self.closed = name, False
            opened.append(self)

        def generate(self, ids, params):
            assert not any(e.closed for e in opened if e is not self) or self.sequential
            log.append(self.name)
            return [SimpleNamespace(token_ids=[1, 2, 3], timings=SimpleNamespace(ttft_s=0.0), spec=None) for _ in ids]

    def open_engine(stack, name, options, prompts, args):
        engine = Engine(name)
        engine.sequential = args.sequential
        stack.callback(lambda: setattr(engine, "closed", True))
        return engine

    monkeypatch.setattr(ba, "open_engine", open_engine)
    argv = ["--modes", "sd", "--ks", "2", "--max-k", "2", "--temperatures", "0", "--prompts", "2"]
    args = ba.parse_args(argv)
    names = [n for n, _ in ba.configs(args)]
    runs = ba.run_rows(ba.configs(args), _prompts()[:2], args)  # two batches of one humaneval prompt
    assert log == names + names[1:] + names[:1] and [r["config"] for r in runs] == log
    assert len(opened) == 3 and all(e.closed for e in opened)
    log.clear()
    args = ba.parse_args(argv + ["--sequential"])
    ba.run_rows(ba.configs(args), _prompts()[:2], args)
    assert log == [n for n in names for _ in range(2)]


def test_the_chooser_s_prices_are_set_beside_the_rounds_it_chose(pair):
    """One request alone through adaptive SSD: each round that verified is priced by the K chosen a round before
    and its predicted gain, its tokens are what the request got after its first, and its time runs to the next
    round's start."""
    from saguaro import LLM, SamplingParams
    from saguaro.adapt_settings import AdaptSettings
    adapt = AdaptSettings(prior=0.9, probe_interval=2, max_probe_interval=4, probe_budget=1.0)
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, block_size=4, adapt=adapt) as llm:
        out, = llm.generate([[3, 7, 1, 9, 2]], SamplingParams(max_tokens=24))
        trace = SSDRounds(llm.engine.decoder).slice(0, len(llm.engine.decoder.trace))
    spec = out.spec
    assert len(spec.gain_per_round) == len(spec.k_per_round) == len(trace)  # one choice a round, the last unverified
    assert all(r["verify_ms"] is not None for r in trace[1:])  # rounds at K = 0 verified too (no hit, no miss)
    prices = round_prices(trace, spec.k_per_round, spec.gain_per_round)
    assert [p.k for p in prices] == spec.k_per_round[:-1] and [p.predicted for p in prices] == spec.gain_per_round[:-1]
    assert sum(p.tokens for p in prices) == len(out.token_ids) - 1  # the first came with the prompt
    assert [p.seconds for p in prices[:-1]] == [b["start"] - a["start"] for a, b in zip(trace[1:], trace[2:])]
    assert 0 in spec.k_per_round and max(spec.k_per_round) > 0


def test_a_price_table_counts_each_request_s_rounds_in_its_own_ar_steps():
    fast = as_dicts([RoundPrice(1, 1.2, 2, 0.10), RoundPrice(0, 1.0, 1, 0.05)])  # an AR step of 0.05 s
    slow = as_dicts([RoundPrice(1, 1.4, 1, 0.20)])  # an AR step of 0.1 s
    assert price_table([(fast, 0.05), (slow, 0.1)]) == [
        {"k": 0, "rounds": 1, "predicted": 1.0, "realized": pytest.approx(1.0)},
        {"k": 1, "rounds": 2, "predicted": pytest.approx(1.3), "realized": pytest.approx(3 / 4)}]
    where = {"temperature": 0.0, "dataset": "mtbench", "batch": 1, "prompts": [0]}
    runs = [dict(where, config="AR", decode_tok_s=20.0), dict(where, config="SSD adaptive K<=3", round_prices=fast)]
    row, _ = ba.chooser_prices(runs)  # paired with AR's run on the same prompt
    assert row["config"] == "SSD adaptive K<=3" and row["k"] == 0 and row["realized"] == pytest.approx(1.0)


@pytest.mark.slow
def test_bench_adapt_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "saguaro.cli", "bench", "adapt", "--target", "smollm2-135m", "--draft",
           "smollm2-135m", "--modes", "sd", "--ks", "2", "--max-k", "2", "--prompts", "1", "--max-tokens", "4",
           "--datasets", "humaneval,mtbench-writing", "--temperatures", "0,1", "--mixed", "--warmup-tokens", "0",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "bench_adapt.json").read_text())
    assert payload["rows"] == ["AR", "SD K=2", "SD adaptive K<=2"]
    assert {(c["temperature"], c["dataset"]) for c in payload["cells"]} == {
        (t, d) for t in (0.0, 1.0) for d in ("humaneval", "mtbench-writing", ba.MIXED)}
    equal, compared = payload["greedy_equal_ar"]
    assert equal == compared == 8  # 2 speculative rows x 4 greedy requests (one per dataset, the mixed two)
    assert (tmp_path / "bench_adapt_k.png").stat().st_size > 0
    assert "x best" in done.stdout
