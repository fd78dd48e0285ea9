"""calibration/miss_rounds.py: what each fallback delivers in the round after a miss, and the policy using it."""
import copy

import pytest

from saguaro.calibration.miss_rounds import MIN_MISS_ROUNDS, follow_ups, miss_tokens
from saguaro.calibration.policy import entry_at, evaluate
from saguaro.calibration.profile import Source, default_profile
from saguaro.ssd.ranks import RankRecord


def test_follow_ups_replay_the_ngram_and_take_the_next_jit_round():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 7, 7, 7, 7, 7, 7]
    records = [RankRecord("p", 3, 1, 0, 0.0, None, 0, 6),  # context ...4,1,2: the n-gram proposes 3,4,1 (right)
               RankRecord("p", 3, 2, 5, 0.0, None, 0, 9),  # context ...4,1: proposes 2,3,4; the target said 2,7,7
               RankRecord("p", 3, 3, 2, 0.0, None, 0, 12),  # the last round: no next round
               RankRecord("b", 3, 0, 1, 0.0, None, 0, 13),  # backup rounds are not annotated
               RankRecord("p", 3, 0, -1, 0.0, None, 1, 4)]  # unranked
    rows = follow_ups(records, {0: tokens, 1: tokens}, 3)
    # [depth, rank, jit tokens (the next round's accepted + 1), n-gram tokens (matched + 1)]
    assert rows == [[1, 0, 3, 4], [2, 5, 4, 2]]


def test_miss_tokens_average_only_the_rounds_the_fan_out_misses():
    rows = [[0, 0, 5, 5], [0, 2, 2, 1], [3, 1, 4, 3]] * MIN_MISS_ROUNDS
    source = Source(follow_ups=rows)
    assert miss_tokens(source, [1, 1, 1, 1], "jit") == pytest.approx(3.0)  # rows 2 and 3 miss at F = 1
    assert miss_tokens(source, [1, 1, 1, 1], "ngram") == pytest.approx(2.0)
    assert miss_tokens(source, [3, 1, 1, 2], "jit") is None  # nothing misses
    assert miss_tokens(Source(follow_ups=rows[:3]), [1, 1, 1, 1], "jit") is None  # too few misses
    assert miss_tokens(Source(), [1, 1, 1, 1], "jit") is None


def test_policy_takes_e_miss_after_misses_when_calibrated():
    profile = default_profile("t", "d", "bfloat16", 3)
    plain = {fb: evaluate(profile, entry_at(profile, 0.0), 3, 1, 4, fb, 1000) for fb in ("jit", "ngram")}
    annotated = copy.deepcopy(profile)
    for entry in annotated.temperatures.values():
        entry.primary.follow_ups = [[d, 99, 2, 1] for d in range(4)] * MIN_MISS_ROUNDS  # every round misses
    after = {fb: evaluate(annotated, entry_at(annotated, 0.0), 3, 1, 4, fb, 1000) for fb in ("jit", "ngram")}
    assert after["jit"].e_miss == pytest.approx(2.0) and after["ngram"].e_miss == pytest.approx(1.0)
    assert plain["jit"].e_miss > 2.0
    assert after["jit"].speedup < plain["jit"].speedup  # fewer tokens after a miss, same costs
