"""The statistics of the benchmarks: bootstrap confidence intervals over rounds and the goals' PASS/MISS/OPEN
(benchmarks/_common.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks._common import bootstrap_ci, goal_status, ratio_of_sums


def mean0(a: np.ndarray) -> float:
    return float(a[:, 0].mean()) if a.ndim == 2 else float(a.mean())


values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)
samples = st.lists(values, min_size=2, max_size=30)
pairs = st.lists(st.tuples(positive, positive), min_size=2, max_size=30)


def test_too_few_samples_give_no_interval():
    assert bootstrap_ci([], mean0) is None
    assert bootstrap_ci([1.0], mean0) is None


def test_identical_samples_give_a_point():
    assert bootstrap_ci([0.3] * 7, mean0) == (0.3, 0.3)


def test_two_samples_span_their_range():
    # resampled means of [a, b] are a (1/4), (a+b)/2 (1/2) or b (1/4): the 2.5 % and 97.5 % points are a and b
    assert bootstrap_ci([1.0, 5.0], mean0) == (1.0, 5.0)


def test_exact_ratio_of_paired_rows():
    rows = [(2 * d, d) for d in (0.5, 1.25, 3.0, 7.5, 0.75)]  # doubling is exact in floating point
    assert ratio_of_sums(np.asarray(rows)) == 2.0
    assert bootstrap_ci(rows, ratio_of_sums) == (2.0, 2.0)


def test_same_seed_same_interval_and_seeds_differ():
    data = list(np.random.default_rng(7).normal(1.0, 0.3, size=20))
    assert bootstrap_ci(data, mean0, seed=3) == bootstrap_ci(data, mean0, seed=3)
    assert bootstrap_ci(data, mean0, seed=3) != bootstrap_ci(data, mean0, seed=4)


def test_wider_level_gives_a_wider_interval():
    data = [0.9, 1.1, 1.4, 0.7, 1.0, 1.3, 2.0, 0.4]
    lo90, hi90 = bootstrap_ci(data, mean0, level=0.90)
    lo99, hi99 = bootstrap_ci(data, mean0, level=0.99)
    assert lo99 <= lo90 and hi90 <= hi99


def test_non_finite_statistics_are_left_out():
    rows = [(1.0, 0.0), (3.0, 1.0), (2.0, 1.0), (4.0, 1.0)]  # 0.4 % of resamples hold only the first row: 1/0
    lo, hi = bootstrap_ci(rows, ratio_of_sums)
    assert np.isfinite(lo) and np.isfinite(hi) and 2.0 <= lo <= hi <= 7.0  # from (2, 1) alone to 1+1+1+4 over 1
    assert bootstrap_ci([(1.0, 0.0), (2.0, 0.0)], ratio_of_sums) is None


@given(samples)
def test_interval_is_ordered_and_contains_the_mean(xs):
    lo, hi = bootstrap_ci(xs, mean0)
    point = mean0(np.asarray(xs))
    tol = 1e-9 * max(1.0, max(abs(x) for x in xs))
    assert lo <= hi
    assert lo - tol <= point <= hi + tol
    assert min(xs) - tol <= lo and hi <= max(xs) + tol


@given(pairs)
def test_ratio_interval_contains_the_ratio_of_totals(rows):
    lo, hi = bootstrap_ci(rows, ratio_of_sums)
    point = ratio_of_sums(np.asarray(rows))
    ratios = [a / b for a, b in rows]
    assert lo <= hi
    assert lo * (1 - 1e-9) <= point <= hi * (1 + 1e-9)
    assert min(ratios) * (1 - 1e-9) <= lo and hi <= max(ratios) * (1 + 1e-9)


@given(st.lists(values, min_size=3, max_size=12), st.integers(min_value=4, max_value=8))
def test_more_copies_of_the_same_samples_narrow_the_interval(xs, k):
    lo1, hi1 = bootstrap_ci(xs, mean0)
    lok, hik = bootstrap_ci(xs * k, mean0)
    tol = 1e-9 * max(1.0, max(abs(x) for x in xs))
    assert hik - lok <= hi1 - lo1 + tol


@pytest.mark.parametrize("n", [5, 10, 40])
def test_interval_of_a_normal_sample_covers_its_mean_and_shrinks(n):
    rng = np.random.default_rng(1)
    widths = []
    for m in (n, 4 * n):
        xs = list(rng.normal(10.0, 1.0, size=m))
        lo, hi = bootstrap_ci(xs, mean0)
        assert lo < 10.0 < hi or abs(np.mean(xs) - 10.0) > 2 / np.sqrt(m)
        widths.append(hi - lo)
    assert widths[1] < widths[0]


def test_ratio_over_a_denominator_that_is_not_positive_is_unbounded():
    def ratio(a: np.ndarray) -> float:
        num, den = float(a[:, 0].mean()), float(a[:, 1].mean())
        return num / den if den > 0 else (np.inf if num > 0 else np.nan)

    rows = [(1.0, 0.5), (1.2, -0.4), (0.9, 0.6), (1.1, -0.3), (1.0, 0.2)]
    lo, hi = bootstrap_ci(rows, ratio)
    assert np.isfinite(lo) and hi == np.inf


def test_mostly_undefined_statistic_has_no_interval():
    rows = [(0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (1.0, 1.0)]  # 0/0 unless the last row is drawn: 32 % of resamples
    assert bootstrap_ci(rows, ratio_of_sums) is None


def test_the_linear_planner_merge_gives_dcps_global_plan_and_metadata():
    """``ckpt_core.planner.LinearMergePlanner`` merges planner data in one pass; what it plans is DCP's plan, and for a
    key in several ranks' mappings the first rank's value wins, as in DCP's ChainMap."""
    from collections import ChainMap

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from benchmarks.scale import local_plan
    from ckpt_core.planner import LinearMergePlanner, merge_planner_data

    for case in ("sharded", "replicated"):
        plans = [local_plan(r, 16, 6, case) for r in range(16)]
        stock_plan, stock_md = DefaultSavePlanner().create_global_plan(plans)
        ours_plan, ours_md = LinearMergePlanner().create_global_plan(plans)
        assert ours_plan == stock_plan
        assert ours_md.state_dict_metadata == stock_md.state_dict_metadata
        assert ours_md.planner_data == stock_md.planner_data and len(ours_md.planner_data) > 16
    maps = [{"a": 1, "r0": 0}, {"a": 2, "r1": 1}, {"b": 3, "a": 4}]
    assert merge_planner_data(maps) == dict(ChainMap(*maps)) == {"a": 1, "r0": 0, "r1": 1, "b": 3}


def test_a_goal_passes_only_when_the_whole_interval_meets_it():
    assert goal_status((0.2, 0.4), 0.5) == "PASS"
    assert goal_status((0.2, 0.5), 0.5) == "PASS"  # the limit itself meets an "at most" goal
    assert goal_status((0.4, 0.6), 0.5) == "OPEN"
    assert goal_status((0.6, 0.9), 0.5) == "MISS"
    assert goal_status((0.9, 1.2), 0.8, higher_is_better=True) == "PASS"
    assert goal_status((0.7, 0.9), 0.8, higher_is_better=True) == "OPEN"
    assert goal_status((0.5, 0.7), 0.8, higher_is_better=True) == "MISS"
    assert goal_status(None, 0.5) == "n/a"


def test_the_read_goals_are_ratios_of_totals_over_the_cycles_with_their_status():
    """benchmarks.recovery: the cold read's time over the load's (>= 0.8x) and the verify's over the load's
    (<= 15 %), totals over the cycles; a cycle without a cold read counts in the verify goal only."""
    from benchmarks.recovery import read_goals

    cycles = [{"cold_read_s": r, "phases": {"load": load, "verify": v}}
              for r, load, v in ((0.9, 1.0, 0.01), (1.1, 1.0, 0.02), (1.0, 1.0, 0.03), (None, 2.0, 0.5))]
    read, verify = read_goals(cycles)
    assert (read["n"], verify["n"]) == (3, 4)
    assert read["value"] == pytest.approx(3.0 / 3.0) and read["status"] == "PASS"
    assert verify["value"] == pytest.approx(0.56 / 5.0) and verify["status"] == "OPEN"  # the slow cycle: 25 %
    assert read_goals(cycles[:1])[0]["status"] == "n/a"  # one cycle: no interval
