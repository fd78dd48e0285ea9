"""benchmarks/bench_serve_clients.py's pieces: the FIM cut of HumanEval and the summaries (the run itself is
tests/test_cli_commands.py's smoke case)."""
from benchmarks.bench_serve_clients import Sample, Workload, fim_pairs
from saguaro import datasets


def test_fim_pairs_cut_a_middle_out_of_the_canonical_solution():
    records = datasets.humaneval_records(20)
    for (prefix, suffix), item in zip(fim_pairs(20), records):
        whole = item["prompt"] + item["canonical_solution"]
        assert prefix.startswith(item["prompt"]) and whole.startswith(prefix) and whole.endswith(suffix)
        middle = whole[len(prefix):len(whole) - len(suffix)]
        assert middle.strip() and middle.endswith("\n") and len(prefix) + len(suffix) < len(whole)


def test_medians_skip_requests_without_a_decode_and_acceptance_is_pooled():
    w = Workload()
    w.add("x", Sample(tok_s=10.0, tokens=8, drafted=10, accepted=9))
    w.add("x", Sample(tok_s=0.0, tokens=1))  # one token: no decode speed
    w.add("x", Sample(tok_s=30.0, tokens=8, drafted=30, accepted=3))
    assert w.tok_s("x") == 20.0 and w.acceptance("x") == 12 / 40 and w.tokens("x") == 17 / 3
    assert w.tok_s("y") is None and w.acceptance("y") is None
