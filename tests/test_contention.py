"""Memory-bus contention: the probe measures it, the profile stores it, the policy's predictions account for it."""
import os

import pytest
import torch

from saguaro.calibration import default_profile
from saguaro.calibration.contention import measure, slowdowns
from saguaro.calibration.policy import evaluate
from saguaro.calibration.timeline import rows_time
from tests.tiny import perturbed, tiny_model

VOCAB = 151936


def _probe(busy: list[tuple[int, float, float]]) -> dict:
    """A stored probe: (draft rows, target slowdown, draft passes per second)."""
    return {"busy": [{"draft_rows": w, "slowdown": s, "draft_passes_per_s": r} for w, s, r in busy]}


def test_slowdowns_interpolate_in_the_draft_width():
    timing = default_profile("a", "b", "bfloat16", 3)["timing"]
    assert slowdowns(timing, 4) == (1.0, 1.0)  # no probe: no contention assumed
    alone1, alone8 = rows_time(timing["draft_rows"], 1), rows_time(timing["draft_rows"], 8)
    timing["contention"] = _probe([(1, 1.4, 0.5 / alone1), (8, 1.2, 1 / (1.5 * alone8))])
    target, draft = slowdowns(timing, 1)
    assert target == pytest.approx(1.4) and draft == pytest.approx(2.0)  # half the passes of running alone
    assert slowdowns(timing, 8) == pytest.approx((1.2, 1.5))
    assert slowdowns(timing, 4.5)[0] == pytest.approx(1.3)
    assert slowdowns(timing, 64) == pytest.approx((1.2, 1.5))  # clamped to the widths probed
    timing["contention"] = _probe([(1, 0.97, 1e9)])  # noise below 1 never speeds anything up
    assert slowdowns(timing, 1) == (1.0, 1.0)


def test_predictions_pay_for_contention():
    """The same plan predicts proportionally fewer tokens per second when verification is slowed."""
    profile = default_profile("a", "b", "bfloat16", 3)
    entry = profile["temperatures"]["0.0"]
    free = evaluate(profile, entry, 3, 1, 4, "jit", VOCAB)
    profile["timing"]["contention"] = _probe([(1, 1.3, 1e9), (64, 1.3, 1e9)])
    slowed = evaluate(profile, entry, 3, 1, 4, "jit", VOCAB)
    assert slowed.verify_s == pytest.approx(1.3 * free.verify_s)
    assert slowed.tok_s < free.tok_s / 1.1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probe needs two cores")
def test_probe_on_tiny_models_restores_pinning():
    target = tiny_model(seed=3, vocab=64, layers=2)
    draft = perturbed(target, noise=0.1)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    probe = measure(target, draft, 4, [1, 3], dtype=torch.float32, context=32, reps=3)
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
    assert probe["idle_ms_median"] > 0 and [b["draft_rows"] for b in probe["busy"]] == [1, 3]
    assert all(b["slowdown"] > 0 and b["draft_passes_per_s"] > 0 and len(b["verify_ms"]) == 3 for b in probe["busy"])
