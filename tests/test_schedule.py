from __future__ import annotations

import math
import random

import pytest

from ckpt_core.schedule import (
    SaveSchedule,
    cluster_mtbf_seconds,
    daly_interval,
    expected_overhead,
    optimal_interval,
    young_interval,
)

MIN = 60.0
HOUR = 3600.0


def test_seed_anchor_cluster_mtbf():
    assert cluster_mtbf_seconds(1000, 10_000) == pytest.approx(6 * MIN)
    assert cluster_mtbf_seconds(1000, 1) == pytest.approx(1000 * HOUR)


@pytest.mark.parametrize(
    "cost_s, mtbf_s, expected_s",
    [
        (5 * MIN, 24 * HOUR, 117 * MIN),
        (5 * MIN, 6 * HOUR, 57 * MIN),
        (5 * MIN, 15 * MIN, 9.1 * MIN),
    ],
)
def test_daly_anchors(cost_s, mtbf_s, expected_s):
    assert daly_interval(cost_s, mtbf_s) == pytest.approx(expected_s, rel=0.02)


def test_daly_falls_back_to_mtbf_when_cost_exceeds_twice_mtbf():
    assert daly_interval(cost_s=700, mtbf_s=300) == 300
    assert daly_interval(cost_s=600, mtbf_s=300) == 300


@pytest.mark.parametrize("cost_s, mtbf_s", [(1, 1e6), (10, 1e7), (0.5, 86400)])
def test_young_matches_daly_when_cost_is_small(cost_s, mtbf_s):
    young = young_interval(cost_s, mtbf_s)
    assert young == pytest.approx(math.sqrt(2 * cost_s * mtbf_s))
    assert daly_interval(cost_s, mtbf_s) == pytest.approx(young, rel=0.01)


@pytest.mark.parametrize(
    "cost_s, mtbf_s, lo, hi, expected",
    [
        (5 * MIN, 24 * HOUR, 60, 3600, 3600),  # Daly ~7000 s, clamped down
        (0.01, 360, 60, 3600, 60),  # Daly ~2.7 s, clamped up
        (5 * MIN, 6 * HOUR, 60, 7200, daly_interval(5 * MIN, 6 * HOUR)),
    ],
)
def test_optimal_interval_clamps(cost_s, mtbf_s, lo, hi, expected):
    assert optimal_interval(cost_s, mtbf_s, lo, hi) == pytest.approx(expected)


@pytest.mark.parametrize(
    "interval_s, cost_s, mtbf_s, expected",
    [
        (600, 10, 3600, 10 / 600 + 610 / 7200),
        (3600, 0, 1e9, 3600 / 2e9),
        (1, 10, 3600, 1.0),  # capped
    ],
)
def test_expected_overhead(interval_s, cost_s, mtbf_s, expected):
    assert expected_overhead(interval_s, cost_s, mtbf_s) == pytest.approx(expected)


def test_daly_interval_is_near_minimum_of_overhead_model():
    cost, mtbf = 30.0, 6 * HOUR
    best = daly_interval(cost, mtbf)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert expected_overhead(best, cost, mtbf) < expected_overhead(best * factor, cost, mtbf)


def test_cost_is_moving_median():
    s = SaveSchedule(interval="auto", device_mtbf_hours=1000, cost_window=3, initial_cost_s=7.0)
    assert s.cost_s == 7.0
    expected = [10.0, 55.0, 20.0, 30.0, 30.0, 30.0]
    for cost, want in zip([10, 100, 20, 30, 1000, 5], expected):
        s.record_cost(cost)
        assert s.cost_s == want


@pytest.mark.parametrize(
    "step, expected",
    [(0, False), (1, False), (99, False), (100, True), (150, False), (200, True)],
)
def test_every_n_steps_trigger(step, expected):
    assert SaveSchedule(every_n_steps=100).should_save(step, elapsed_s=1e9) is expected


@pytest.mark.parametrize(
    "step, elapsed_s, expected",
    [(1, 0.0, False), (1, 299.9, False), (1, 300.0, True), (7, 301.0, True), (50, 10.0, True)],
)
def test_every_seconds_or_steps(step, elapsed_s, expected):
    s = SaveSchedule(every_n_steps=50, every_seconds=300)
    assert s.should_save(step, elapsed_s) is expected


def test_no_trigger_never_saves():
    s = SaveSchedule()
    assert not any(s.should_save(step, 1e9) for step in range(0, 1000))
    assert s.interval_s is None and not s.needs_time_sync


def test_auto_trigger_uses_daly_interval():
    # 1000 h per device over 10,000 devices: M = 360 s. C = 5 s -> Daly ~56.7 s.
    s = SaveSchedule(
        interval="auto", device_mtbf_hours=1000, n_devices=10_000,
        min_interval_s=10, initial_cost_s=5.0,
    )
    assert s.mtbf_s == pytest.approx(360)
    assert s.interval_s == pytest.approx(daly_interval(5, 360))
    assert s.interval_s == pytest.approx(56.71, abs=0.01)
    assert not s.should_save(3, 56.0)
    assert s.should_save(3, 57.0)
    assert s.expected_overhead == pytest.approx(expected_overhead(s.interval_s, 5, 360))


def test_auto_without_cost_saves_at_min_interval_then_adapts():
    s = SaveSchedule(interval="auto", device_mtbf_hours=24, n_devices=1, min_interval_s=120)
    assert s.cost_s is None and s.expected_overhead is None
    assert s.interval_s == 120
    assert not s.should_save(1, 119.0)
    assert s.should_save(1, 120.0)
    s.record_cost(30.0)
    assert s.interval_s == pytest.approx(daly_interval(30, 24 * HOUR))
    assert not s.should_save(2, 120.0)
    assert s.describe() == {
        "interval_s": s.interval_s,
        "cost_s": 30.0,
        "write_s": None,
        "mtbf_s": 24 * HOUR,
        "expected_overhead": expected_overhead(s.interval_s, 30, 24 * HOUR),
    }


def test_describe_without_auto():
    s = SaveSchedule(every_seconds=600)
    assert s.describe() == {
        "interval_s": 600, "cost_s": None, "write_s": None, "mtbf_s": None, "expected_overhead": None,
    }


@pytest.mark.parametrize(
    "kwargs, needs_sync",
    [
        (dict(), False),
        (dict(every_n_steps=10), False),
        (dict(every_seconds=60), True),
        (dict(interval="auto", device_mtbf_hours=1000), True),
        (dict(every_n_steps=10, interval="auto", device_mtbf_hours=1000), True),
    ],
)
def test_needs_time_sync(kwargs, needs_sync):
    assert SaveSchedule(**kwargs).needs_time_sync is needs_sync


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(every_n_steps=0), "checkpoint setting every_n_steps=0 is invalid: expected a positive integer or None"),
        (dict(every_n_steps=2.5), "every_n_steps=2.5 is invalid: expected a positive integer or None"),
        (dict(every_seconds=-5), "every_seconds=-5 is invalid: expected a positive number of seconds/hours or None"),
        (dict(every_seconds=0), "every_seconds=0 is invalid"),
        (dict(interval="auto"), "device_mtbf_hours=None is invalid: expected a number of hours when interval='auto'"),
        (dict(interval="hourly"), "interval='hourly' is invalid: expected 'auto' or None"),
        (dict(interval="auto", device_mtbf_hours=-1), "device_mtbf_hours=-1 is invalid"),
        (dict(n_devices=0), "n_devices=0 is invalid: expected a positive integer or None"),
        (dict(min_interval_s=0), "min_interval_s=0 is invalid: expected a positive number of seconds"),
        (dict(min_interval_s=100, max_interval_s=50), "min_interval_s=100 is invalid: expected at most max_interval_s=50"),
        (dict(cost_window=0), "cost_window must be a positive integer, got 0"),
        (dict(initial_cost_s=-1), "initial_cost_s must be a number >= 0, got -1"),
    ],
)
def test_schedule_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        SaveSchedule(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cluster_mtbf_seconds(0, 10), "device_mtbf_hours must be a positive number"),
        (lambda: cluster_mtbf_seconds(1000, 0), "n_devices must be a positive integer"),
        (lambda: daly_interval(-1, 100), "cost_s must be a number >= 0"),
        (lambda: young_interval(1, 0), "mtbf_s must be a positive number"),
        (lambda: optimal_interval(1, 100, 50, 10), "min_interval (50) must be <= max_interval"),
        (lambda: expected_overhead(0, 1, 100), "interval_s must be a positive number"),
        (lambda: SaveSchedule().record_cost(-1), "blocking_s must be a number >= 0"),
        (lambda: SaveSchedule().should_save(1, math.nan), "elapsed_s must be a number >= 0"),
    ],
)
def test_function_validation(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


def make_rank_schedule() -> SaveSchedule:
    return SaveSchedule(
        every_n_steps=37, every_seconds=900, interval="auto",
        device_mtbf_hours=50, n_devices=64, min_interval_s=30, max_interval_s=1200,
    )


def test_two_ranks_fed_synchronized_values_never_disagree():
    """Ranks agree only because elapsed_s and costs are broadcast, not read locally."""
    rng = random.Random(1234)
    rank0, rank1 = make_rank_schedule(), make_rank_schedule()
    elapsed, saves = 0.0, 0
    for step in range(1, 20_000):
        elapsed += rng.uniform(0.05, 3.0)  # rank 0's clock, broadcast to all ranks
        decision = rank0.should_save(step, elapsed)
        assert rank1.should_save(step, elapsed) == decision
        if decision:
            saves += 1
            cost = rng.uniform(1.0, 40.0)  # agreed blocking cost, e.g. max over ranks
            rank0.record_cost(cost)
            rank1.record_cost(cost)
            elapsed = 0.0
    assert saves > 100
    assert rank0.describe() == rank1.describe()


def test_local_clocks_would_let_ranks_disagree():
    """Why the caller must broadcast: skewed local clocks split the decision."""
    rank0, rank1 = SaveSchedule(every_seconds=60), SaveSchedule(every_seconds=60)
    assert rank0.should_save(5, elapsed_s=60.01) != rank1.should_save(5, elapsed_s=59.99)
