"""Memory-bus contention: the probe measures it, the profile stores it, the policy's predictions account for it."""
import os

import pytest
import torch

from saguaro.calibration import default_profile
from saguaro.calibration.contention import measure
from saguaro.calibration.policy import evaluate
from saguaro.calibration.profile import BusyDraft, ContentionProbe
from saguaro.calibration.timeline import rows_time, slowdowns
from tests.tiny import perturbed, tiny_model

VOCAB = 151936


def _probe(busy: list[tuple[int, float, float]]) -> ContentionProbe:
    """A stored probe: (draft rows, target slowdown, draft passes per second)."""
    return ContentionProbe(busy=[BusyDraft(draft_rows=w, slowdown=s, draft_passes_per_s=r) for w, s, r in busy])


def test_slowdowns_interpolate_in_the_draft_width():
    timing = default_profile("a", "b", "bfloat16", 3).timing
    assert slowdowns(timing, 4) == (1.0, 1.0)  # no probe: no contention assumed
    alone1, alone8 = rows_time(timing.draft_rows, 1), rows_time(timing.draft_rows, 8)
    timing.contention = _probe([(1, 1.4, 0.5 / alone1), (8, 1.2, 1 / (1.5 * alone8))])
    target, draft = slowdowns(timing, 1)
    assert target == pytest.approx(1.4) and draft == pytest.approx(2.0)  # half the passes of running alone
    assert slowdowns(timing, 8) == pytest.approx((1.2, 1.5))
    assert slowdowns(timing, 4.5)[0] == pytest.approx(1.3)
    assert slowdowns(timing, 64) == pytest.approx((1.2, 1.5))  # clamped to the widths probed
    timing.contention = _probe([(1, 0.97, 1e9)])  # noise below 1 never speeds anything up
    assert slowdowns(timing, 1) == (1.0, 1.0)


def test_predictions_pay_for_contention():
    """The same plan predicts proportionally fewer tokens per second when verification is slowed."""
    profile = default_profile("a", "b", "bfloat16", 3)
    entry = profile.temperatures["0.0"]
    free = evaluate(profile, entry, 3, 1, 4, "jit", VOCAB)
    profile.timing.contention = _probe([(1, 1.3, 1e9), (64, 1.3, 1e9)])
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
    assert probe.idle_ms_median > 0 and [b.draft_rows for b in probe.busy] == [1, 3]
    assert all(b.slowdown > 0 and b.draft_passes_per_s > 0 and len(b.verify_ms) == 3 for b in probe.busy)
    assert probe.target_pass_bytes > 0 and probe.draft_pass_bytes > 0  # what one pass of each streams
    assert all(b.bus_bytes_per_s > 0 for b in probe.busy)


# -- the bus itself (saguaro.calibration.bus) --------------------------------------------------------------

def test_stream_rate_of_one_core():
    from saguaro.calibration.bus import stream_rates
    (rate,) = stream_rates([0], seconds=0.3, nbytes=64 << 20)
    assert 1e8 < rate < 1e12  # bytes per second: above 0.1 GB/s, below any memory bus


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bus probe needs two cores")
def test_bus_probe_alone_and_together():
    from saguaro.calibration.bus import measure_bus
    bus = measure_bus([0, 1], seconds=0.3, reps=1, nbytes=64 << 20)
    assert set(bus["alone_bytes_per_s"]) == {"0", "1"} and len(bus["together_bytes_per_s"][0]) == 2
    assert bus["bus_alone"] == max(v[0] for v in bus["alone_bytes_per_s"].values())
    assert bus["bus_total"] == pytest.approx(sum(bus["together_bytes_per_s"][0]))


def _matrix_weights(cfg) -> int:
    """Weights of every matrix one pass streams: q/k/v, o, gate/up, down per layer, and the head."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def test_pass_bytes_eager_counts_parameters_less_the_embedding_table():
    from saguaro.calibration.bus import pass_bytes
    from saguaro.engine.model_runner import ModelRunner
    loaded = tiny_model(seed=1, vocab=64, layers=2)
    runner = ModelRunner(loaded.model, 8, 16)
    params = sum(p.numel() for p in loaded.model.parameters())
    assert pass_bytes(runner) == 4 * (params - 64 * loaded.config.hidden_size)  # fp32, untied head


def test_pass_bytes_fast_path_is_the_packed_arena():
    from saguaro.calibration.bus import pass_bytes
    from saguaro.backends.cpu_kernels import build as kernels
    from saguaro.engine.model_runner import draft_runner
    from saguaro.models.draft_format import DraftFormat
    if not kernels.available():
        pytest.skip("no CPU kernel tier could be built here (no C++ compiler)")
    loaded = tiny_model(seed=1, vocab=64, layers=2)  # every matrix a whole number of 64-output tiles
    loaded.model.to(torch.bfloat16)
    weights = _matrix_weights(loaded.config)
    assert pass_bytes(draft_runner(DraftFormat(), loaded, 8, 16, "cpu", enforce_eager=False)) == 2 * weights
    int4 = draft_runner(DraftFormat("int4"), loaded, 8, 16, "cpu", enforce_eager=False)
    assert pass_bytes(int4) == weights * 5 // 8  # 5 bits
