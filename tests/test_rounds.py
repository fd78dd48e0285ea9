"""benchmarks/rounds.py: the round timer wraps a live SD decoder without changing what it produces."""
from benchmarks.rounds import RoundTimer
from saguaro import LLM, SamplingParams
from tests.tiny import weak_pair


def test_round_timer_times_sd_rounds_and_keeps_the_output():
    target, draft = weak_pair()
    params = SamplingParams(max_tokens=8)
    with LLM(target=target, draft=draft, mode="sd", num_speculative_tokens=3, block_size=4,
             adaptive=False) as llm:  # K = 3 every round: the drafts the timer counts
        plain = llm.generate([[1, 2, 3]], params)[0].token_ids
        timer = RoundTimer(llm.engine.decoder)
        timed = llm.generate([[1, 2, 3]], params)[0].token_ids
    assert timed == plain
    assert timer.rounds and all(r["draft_ms"] >= 0 and r["verify_ms"] >= 0 for r in timer.rounds)
    assert all(0 <= r["drafted"] <= 3 for r in timer.rounds) and max(r["drafted"] for r in timer.rounds) == 3
