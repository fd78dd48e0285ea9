"""saguaro.theory.bandwidth: the round floor and the bus cap on a shared memory bus.

The floor is checked against a fluid model of two byte streams sharing one bus (the oracle below):
whatever share of the bus each core gets, no round can be shorter than the floor, and for some
shares it is reached."""

import itertools

import numpy as np
import pytest

from saguaro.theory import expected_tokens, ssd_over_sd_bounds
from saguaro.theory.bandwidth import bus_cap, ssd_round_floor, ssd_tok_s_ceiling

GB = 1e9


def fluid_round(target_bytes, target_solo, draft_bytes, draft_solo, bus_total, target_share):
    """Time until both streams are done when they share a bus of ``bus_total``: each streams at most at its
    solo rate; while both run, the target is offered ``target_share`` of the bus and the draft the rest,
    and whatever one cannot use goes to the other."""
    t, left_t, left_d = 0.0, float(target_bytes), float(draft_bytes)
    while left_t > 1e-9 and left_d > 1e-9:
        rt = min(target_solo, target_share * bus_total)
        rd = min(draft_solo, bus_total - rt)
        rt = min(target_solo, bus_total - rd)
        dt = min(left_t / rt, left_d / rd)
        t, left_t, left_d = t + dt, left_t - rt * dt, left_d - rd * dt
    return t + max(left_t, 0.0) / target_solo + max(left_d, 0.0) / draft_solo


@pytest.mark.parametrize("seed", range(40))
def test_no_sharing_of_the_bus_beats_the_floor(seed):
    rng = np.random.default_rng(seed)
    wt, wd = rng.uniform(0.5, 4) * GB, rng.uniform(0.01, 1) * GB
    b1_t, b1_d = rng.uniform(10, 40) * GB, rng.uniform(10, 40) * GB  # each core alone
    b2 = rng.uniform(1.0, 2.0) * max(b1_t, b1_d)
    k = int(rng.integers(1, 8))
    floor = ssd_round_floor(wt / b1_t, wt, wd, k + 1, b2)
    total = wt + (k + 1) * wd
    shares = list(np.linspace(0.05, 0.95, 19)) + [wt / total]
    times = [fluid_round(wt, b1_t, (k + 1) * wd, b1_d, b2, share) for share in shares]
    assert min(times) >= floor * (1 - 1e-9)
    # bus-limited rounds reach the floor when the bus is split in proportion to the bytes
    if total / b2 >= wt / b1_t and (k + 1) * wd / (total / b2) <= b1_d:
        assert times[-1] == pytest.approx(floor, rel=1e-6)


def test_floor_is_the_verification_when_the_bus_has_room():
    assert ssd_round_floor(0.1, 3 * GB, 0.2 * GB, 5, 1e15) == pytest.approx(0.1)
    assert ssd_round_floor(0.1, 3 * GB, 0.2 * GB, 5, 40 * GB) == pytest.approx(4.0 / 40)
    assert ssd_round_floor(0.1, 3 * GB, 0.0, 5, 40 * GB) == pytest.approx(0.1)


def test_ceiling_with_a_free_bus_is_corollary_4s_upper_bound():
    """With B_2 unbounded the ceiling over SD is 1 + T_SD (in verifications): Cor. 4's upper bound at E_hit = E_SD."""
    e, tv, td, k = expected_tokens(0.85, 4), 0.115, 0.010, 4
    sd_tok_s = e / (tv + k * td)
    ceiling = ssd_tok_s_ceiling(e, tv, 3 * GB, 0.26 * GB, k, bus_total=1e18)
    assert ceiling / sd_tok_s == pytest.approx(ssd_over_sd_bounds(1.0, e, e, k * td / tv)[1])


def test_ceiling_counts_k_plus_one_passes_by_default():
    args = dict(tokens_per_round=4.0, verify_s=0.1, target_bytes=3 * GB, draft_bytes=0.25 * GB, k=4,
                bus_total=36 * GB)
    assert ssd_tok_s_ceiling(**args) == pytest.approx(4.0 / ((3 + 5 * 0.25) / 36))
    assert ssd_tok_s_ceiling(**args, draft_passes=2) == pytest.approx(4.0 / 0.1)  # (3 + 0.5) / 36 < 0.1 s


@pytest.mark.parametrize("wd,k,ratio", itertools.product([0.01, 0.1, 0.26, 1.0], [1, 3, 4, 6], [1.0, 1.16, 1.33, 2.0]))
def test_bus_cap_below_the_draft_share_and_the_bus_headroom(wd, k, ratio):
    wt, b1 = 3.1 * GB, 30 * GB
    cap = bus_cap(wt, wd * GB, k, b1, ratio * b1)
    assert cap <= min(1 + k * wd * GB / wt, ratio) + 1e-12  # below 1 too: SSD's extra pass can cost more than it hides
    # by hand: SD round over the bus-limited SSD round
    sd = (wt + k * wd * GB) / b1
    assert cap == pytest.approx(sd / max(wt / b1, (wt + (k + 1) * wd * GB) / (ratio * b1)))


def test_bus_cap_on_the_measured_testbed():
    """Qwen pair, int4 draft, as measured in results/bench_ssd_bus_ceiling.json: W_t 3.087 GB, W_d 0.260 GB; one core
    alone 39.8 GB/s, both together 49.4 GB/s. With kernels at B_1, SSD at K=4 could be at most 1.17x SD at K=4."""
    assert bus_cap(3.087 * GB, 0.260 * GB, 4, 39.8 * GB, 49.4 * GB) == pytest.approx(1.17, abs=0.005)


def test_bad_inputs():
    with pytest.raises(ValueError, match="bus_total"):
        ssd_round_floor(0.1, GB, GB, 2, 0)
    with pytest.raises(ValueError, match=">= 0"):
        ssd_round_floor(0.1, GB, -1.0, 2, GB)
    with pytest.raises(ValueError, match="K must be >= 1"):
        ssd_tok_s_ceiling(3.0, 0.1, GB, GB, 0, GB)
    with pytest.raises(ValueError, match="bus_alone"):
        bus_cap(GB, GB, 2, 0, GB)
