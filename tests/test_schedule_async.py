"""``interval="auto"`` with asynchronous saves: the write time ``W`` floors the interval and lags the commit.

Pure tests of ``schedule`` over plain numbers, then a real ``CheckpointManager``
on a slow ``faulty://`` storage whose Young/Daly interval from the stall alone
would be far below the write time: the interval settles at the write time and
saves stop waiting for each other.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.manager import _log_auto_interval
from ckpt_core.schedule import SaveSchedule, daly_interval, expected_overhead, optimal_interval
from helpers_ckpt import tiny_model

seconds = st.floats(min_value=0.0, max_value=1e5, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def bounds(draw: st.DrawFn) -> tuple[float, float]:
    lo, hi = draw(positive), draw(positive)
    return min(lo, hi), max(lo, hi)


# ------------------------------------------------------------------ pure


@given(cost=seconds, mtbf=positive, lo_hi=bounds(), write=seconds)
def test_interval_never_below_write_time_nor_outside_the_clamp(cost, mtbf, lo_hi, write):
    lo, hi = lo_hi
    interval = optimal_interval(cost, mtbf, lo, hi, write)
    assert interval >= write
    if write <= hi:
        assert lo <= interval <= hi
    else:  # the write time wins over max_interval: a shorter interval would only queue saves
        assert interval == write


@given(c1=seconds, c2=seconds, w1=seconds, w2=seconds, mtbf=positive, lo_hi=bounds())
def test_interval_is_monotone_in_cost_and_write_time(c1, c2, w1, w2, mtbf, lo_hi):
    lo, hi = lo_hi
    (c1, c2), (w1, w2) = sorted((c1, c2)), sorted((w1, w2))
    slack = 1e-9 * max(1.0, mtbf)
    assert optimal_interval(c1, mtbf, lo, hi, w1) <= optimal_interval(c2, mtbf, lo, hi, w1) + slack
    assert optimal_interval(c1, mtbf, lo, hi, w1) <= optimal_interval(c1, mtbf, lo, hi, w2)


@given(interval=positive, cost=seconds, mtbf=positive, write=seconds, restart=seconds)
def test_expected_overhead_adds_the_commit_lag_and_restart(interval, cost, mtbf, write, restart):
    base = expected_overhead(interval, cost, mtbf)
    with_lag = expected_overhead(interval, cost, mtbf, write, restart)
    assert base <= with_lag <= 1.0
    uncapped = cost / interval + ((interval + cost) / 2 + write + restart) / mtbf
    assert with_lag == pytest.approx(min(1.0, uncapped), rel=1e-12)


def test_expected_overhead_anchor():
    # tau = 600 s, C = 10 s, W = 120 s, R = 30 s, M = 3600 s: 10/600 + (305 + 120 + 30)/3600
    assert expected_overhead(600, 10, 3600, 120, 30) == pytest.approx(10 / 600 + 455 / 3600)


def test_commit_lag_leaves_the_optimum_where_it_was():
    """``W`` adds the constant ``W/M``: Daly's interval still beats its neighbours, by the same margins."""
    cost, mtbf, write = 30.0, 6 * 3600.0, 900.0
    best = daly_interval(cost, mtbf)
    for factor in (0.5, 0.8, 1.25, 2.0):
        other = best * factor
        assert expected_overhead(best, cost, mtbf, write) < expected_overhead(other, cost, mtbf, write)
        gap = expected_overhead(other, cost, mtbf, write) - expected_overhead(best, cost, mtbf, write)
        assert gap == pytest.approx(expected_overhead(other, cost, mtbf) - expected_overhead(best, cost, mtbf))


def test_write_time_is_a_moving_median_and_floors_the_auto_interval():
    s = SaveSchedule(interval="auto", device_mtbf_hours=1e-5, min_interval_s=0.01, max_interval_s=100,
                     cost_window=3)
    assert s.write_s is None and s.interval_s == 0.01
    s.record_write(2.0)  # known before any cost: the first interval is already not shorter than a write
    assert s.interval_s == 2.0
    s.record_cost(0.005)
    for write, median in [(4.0, 3.0), (1.0, 2.0), (50.0, 4.0), (3.0, 3.0)]:
        s.record_write(write)
        assert s.write_s == median
        assert s.interval_s == median  # Daly from C = 5 ms and M = 36 ms is ~20 ms: the write time holds it
    assert s.describe()["write_s"] == 3.0
    assert s.expected_overhead == pytest.approx(expected_overhead(3.0, 0.005, 0.036, 3.0))
    assert not s.write_bound


def test_write_time_past_max_interval_wins_and_is_logged(caplog):
    s = SaveSchedule(interval="auto", device_mtbf_hours=1000, min_interval_s=1, max_interval_s=10)
    s.record_cost(5.0)
    assert s.interval_s == 10 and not s.write_bound
    s.record_write(30.0)
    assert s.interval_s == 30.0 and s.write_bound
    assert s.expected_overhead == pytest.approx(5 / 30 + (17.5 + 30) / 3.6e6)  # the lag W counts in the loss
    with caplog.at_level(logging.INFO, logger="ckpt_core"):
        _log_auto_interval(s, "auto")
    assert "write time W=30 s" in caplog.text
    assert "more than max_interval_s=10; the auto interval is the write time" in caplog.text


def test_write_time_does_not_touch_other_triggers():
    s = SaveSchedule(every_seconds=5)
    s.record_write(60.0)
    assert s.interval_s == 5 and not s.write_bound and s.expected_overhead is None


def test_write_time_validation():
    with pytest.raises(ValueError, match="write_s must be a number >= 0"):
        SaveSchedule().record_write(-1)
    with pytest.raises(ValueError, match="write_s must be a number >= 0"):
        optimal_interval(1, 100, 1, 10, write_s=float("nan"))


# ------------------------------------------------------- a slow storage


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on the writer thread, one process
def test_auto_interval_settles_above_the_write_time_on_a_slow_storage(tmp_path):
    """Every file written takes 0.1 s: a save commits ~0.4 s after its dispatch, while Daly's interval
    from the ~10 ms stall and a 36 ms MTBF is ~20 ms. The second save is due at once and waits for the
    first (that wait is part of its cost); from then on the interval is the median write time.

    Without the floor every save after the first would wait ~0.4 s. With it, a settled save waits only
    when its predecessor wrote slower than the median by more than the slack of a step: none or one of
    seven on an idle machine, a few milliseconds each; up to three, 0.2 s in all, with the 2-core machine
    running three such tests at once.
    """
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"delay_per_file_s": 0.1}))
    state = TrainState(model=tiny_model(), rng=False)
    costs: list[float] = []
    with CheckpointManager(f"faulty://{tmp_path / 'run'}", storage_options={"control": str(control)},
                           interval="auto", device_mtbf_hours=1e-5, min_interval_s=0.01, async_mode="thread",
                           keep_last=2, handle_preemption=False, env={}, argv=[]) as m:
        record_cost = m.schedule.record_cost
        m.schedule.record_cost = lambda c: (costs.append(c), record_cost(c))[1]  # type: ignore[method-assign]
        deadline, step, started = time.monotonic() + 30.0, 0, 0
        while started < 9 and time.monotonic() < deadline:
            step += 1
            started += m.maybe_save(step, state)
            time.sleep(0.01)
    saves = m.save_history
    assert started == 9 and len(saves) == 9 and all(s.committed for s in saves)
    writes = [s.write_s for s in saves]
    assert saves[1].wait_s > 0.1 and costs[1] == saves[1].wait_s + saves[1].blocking_s
    assert saves[1].as_metrics()["ckpt/wait_s"] == saves[1].wait_s  # the loggers see the wait, not only the stall
    sched = m.schedule
    settled_waits = [s.wait_s for s in saves[2:] if s.wait_s > 0]
    detail = [(s.step, s.interval_s, s.wait_s, s.blocking_s, s.write_s) for s in saves]
    assert len(settled_waits) <= 3 and sum(settled_waits) < sched.write_s, detail
    assert sched.write_s == statistics.median(writes[-5:])
    assert sched.interval_s >= sched.write_s > 0.2
    assert daly_interval(sched.cost_s, sched.mtbf_s) < 0.25 * sched.write_s
    settled = [s.interval_s for s in saves[3:]]  # the interval each save was started under
    assert min(settled) >= 0.5 * statistics.median(writes)
