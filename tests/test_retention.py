from __future__ import annotations

import math
import random

import pytest

from ckpt_core.records import CheckpointRecord
from ckpt_core.retention import (
    AnyOf,
    KeepBest,
    KeepEveryNSteps,
    KeepEverySeconds,
    KeepLast,
    KeepPermanent,
    build_policy,
    mark_permanent,
    steps_to_delete,
)


def rec(step: int, committed: bool = True, **kw) -> CheckpointRecord:
    kw.setdefault("wall_time", float(step))
    return CheckpointRecord(step=step, path=f"/ckpt/step_{step}", committed=committed, **kw)


STEPS = list(range(5, 201, 5))


def loss_at(step: int) -> float:
    return abs(step - 100) / 100.0


@pytest.mark.parametrize(
    "kwargs, expected_kept",
    [
        (dict(keep_last=3), {190, 195, 200}),
        (dict(keep_last=1), {200}),
        (dict(keep_last=3, keep_every_n_steps=50), {50, 100, 150, 190, 195, 200}),
        (dict(keep_last=2, keep_every_n_steps=40), {40, 80, 120, 160, 195, 200}),
        # loss is lowest at 100; 95 and 105 tie, so the newer (105) wins.
        (dict(keep_last=2, keep_best=("loss", "min", 2)), {100, 105, 195, 200}),
        (dict(keep_last=2, keep_best=("loss", "max", 1)), {200, 195}),
        # 5 and 195 tie at 0.95: the newer wins, so 5 needs a third slot
        (dict(keep_last=2, keep_best=("loss", "max", 2)), {195, 200}),
        (dict(keep_last=2, keep_best=("loss", "max", 3)), {5, 195, 200}),
        (
            dict(keep_last=3, keep_every_n_steps=50, keep_best=("loss", "min", 1)),
            {50, 100, 150, 190, 195, 200},
        ),
        # wall_time = 10 * step, windows of 300 s: first of each is 5, 30, 60, ...
        (dict(keep_last=1, keep_every_seconds=300), {5, 30, 60, 90, 120, 150, 180, 200}),
        (dict(keep_last=None), set(STEPS)),
        (dict(keep_last=None, keep_every_n_steps=50), set(STEPS)),
    ],
)
def test_policy_combinations(kwargs, expected_kept):
    records = [rec(s, wall_time=10.0 * s, metrics={"loss": loss_at(s)}) for s in STEPS]
    deleted = steps_to_delete(records, build_policy(**kwargs))
    assert deleted == sorted(set(STEPS) - expected_kept)


@pytest.mark.parametrize(
    "healthy_map, n, expected",
    [
        # unhealthy ones in the middle do not count and are not kept
        ({10: True, 20: True, 30: False, 40: False, 50: True}, 2, {20, 50}),
        # unhealthy ones newer than the newest healthy are kept as evidence
        ({10: True, 20: True, 30: True, 40: False, 50: False}, 2, {20, 30, 40, 50}),
        # ... but at most n of them
        ({10: True, 20: False, 30: False, 40: False}, 2, {10, 30, 40}),
        ({10: False, 20: False, 30: False}, 2, {20, 30}),
        ({10: True, 20: True}, 5, {10, 20}),
    ],
)
def test_keep_last_healthy_rule(healthy_map, n, expected):
    records = [rec(s, healthy=h) for s, h in healthy_map.items()]
    assert KeepLast(n).keep(records) == expected


def test_unhealthy_never_push_healthy_out_of_keep_last():
    records = [rec(s) for s in range(10, 101, 10)]
    records += [rec(s, healthy=False) for s in range(101, 106)]
    deleted = steps_to_delete(records, build_policy(keep_last=2))
    # healthy 90 and 100 survive; unhealthy 101..105 are newer evidence, capped at 2
    assert deleted == [10, 20, 30, 40, 50, 60, 70, 80, 101, 102, 103]


def test_newest_healthy_survives_even_if_policy_drops_it():
    class KeepNothing:
        def keep(self, records):
            return set()

    records = [rec(10), rec(20), rec(30, healthy=False)]
    assert steps_to_delete(records, KeepNothing()) == [10]


def test_permanent_flag_is_kept():
    records = [rec(s, permanent=(s % 50 == 0)) for s in STEPS]
    deleted = steps_to_delete(records, build_policy(keep_last=2))
    assert set(STEPS) - set(deleted) == {50, 100, 150, 195, 200}


def test_permanent_kept_even_with_policy_lacking_keep_permanent():
    records = [rec(10, permanent=True), rec(20), rec(30)]
    assert steps_to_delete(records, KeepLast(1)) == [20]


@pytest.mark.parametrize(
    "protected, expected",
    [
        ((), [10, 20, 30, 40]),
        ((20,), [10, 30, 40]),
        ({10, 40}, [20, 30]),
        ([999], [10, 20, 30, 40]),
    ],
)
def test_protected_steps(protected, expected):
    records = [rec(s) for s in (10, 20, 30, 40, 50)]
    assert steps_to_delete(records, build_policy(keep_last=1), protected=protected) == expected


@pytest.mark.parametrize(
    "layout, protected, expected",
    [
        # torn dirs older than the newest committed are crash garbage
        ({10: True, 15: False, 20: True, 30: True}, (), [15]),
        # torn dirs newer than the newest committed may be a save in progress
        ({10: True, 20: True, 30: True, 35: False}, (), []),
        ({10: True, 15: False, 30: True, 35: False, 40: False}, (), [15]),
        # protected torn dir (in-flight save) is left alone
        ({10: True, 15: False, 30: True}, (15,), []),
        # no committed checkpoint at all: nothing is touched
        ({5: False, 10: False}, (), []),
        ({}, (), []),
    ],
)
def test_committed_and_torn_mix(layout, protected, expected):
    records = [rec(s, committed=c) for s, c in layout.items()]
    assert steps_to_delete(records, build_policy(keep_last=5), protected=protected) == expected


def test_torn_cleanup_with_keep_last():
    records = [rec(s) for s in (10, 20, 30)] + [rec(25, committed=False), rec(40, committed=False)]
    assert steps_to_delete(records, build_policy(keep_last=1)) == [10, 20, 25]


def test_a_directory_whose_manifest_cannot_be_read_is_never_deleted():
    """Unknown is not torn: an I/O error reading manifest.json may hide a committed checkpoint."""
    records = [rec(10, committed=False, unreadable=True), rec(20), rec(30), rec(15, committed=False)]
    assert steps_to_delete(records, build_policy(keep_last=1)) == [15, 20]


def test_keep_best_ignores_nan_missing_and_unhealthy():
    records = [
        rec(10, metrics={"loss": 0.1}, healthy=False),
        rec(20, metrics={"loss": math.nan}),
        rec(30, metrics={}),
        rec(40, metrics={"loss": 0.5}),
        rec(50, metrics={"loss": 0.3}),
        rec(60, metrics={"acc": 0.9}),
    ]
    assert KeepBest("loss", "min", 1).keep(records) == {50}
    assert KeepBest("loss", "min", 5).keep(records) == {40, 50}
    assert KeepBest("loss", "max", 1).keep(records) == {40}
    assert KeepBest("acc", "max", 3).keep(records) == {60}


def test_keep_every_seconds_windows():
    times = {1: 0.0, 2: 59.9, 3: 60.0, 4: 61.0, 5: 250.0, 6: 299.0}
    records = [rec(s, wall_time=t) for s, t in times.items()]
    assert KeepEverySeconds(60).keep(records) == {1, 3, 5}


def test_simple_policies_and_composition():
    records = [rec(s, permanent=(s == 7)) for s in range(1, 13)]
    assert KeepEveryNSteps(4).keep(records) == {4, 8, 12}
    assert KeepPermanent().keep(records) == {7}
    combined = KeepEveryNSteps(4) | KeepPermanent() | KeepLast(1)
    assert isinstance(combined, AnyOf)
    assert combined.keep(records) == {4, 7, 8, 12}
    assert AnyOf().keep(records) == set()


@pytest.mark.parametrize(
    "step, n, expected",
    [(0, 50, True), (50, 50, True), (100, 50, True), (49, 50, False), (51, 50, False),
     (100, None, False)],
)
def test_mark_permanent(step, n, expected):
    assert mark_permanent(step, n) is expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(keep_last=0), "checkpoint setting keep_last=0 is invalid: expected a positive integer or None"),
        (dict(keep_last=-3), "keep_last=-3 is invalid: expected a positive integer or None"),
        (dict(keep_last=2.5), "keep_last=2.5 is invalid: expected a positive integer or None"),
        (dict(keep_last=True), "keep_last=True is invalid: expected a positive integer or None"),
        (dict(keep_every_n_steps=0), "keep_every_n_steps=0 is invalid: expected a positive integer or None"),
        (dict(keep_every_seconds=-1.0), "keep_every_seconds=-1.0 is invalid: expected a positive number"),
        (dict(keep_every_seconds=math.inf), "keep_every_seconds=inf is invalid: expected a positive number"),
        (dict(keep_best=("loss", "lowest", 1)), "keep_best=('loss', 'lowest', 1) is invalid: expected (metric, "
                                                 "'min'|'max', n) with n a positive integer"),
        (dict(keep_best=("loss", "min", 0)), "keep_best=('loss', 'min', 0) is invalid"),
        (dict(keep_best=("", "min", 1)), "keep_best=('', 'min', 1) is invalid"),
        (dict(keep_best=("loss", "min")), "keep_best=('loss', 'min') is invalid"),
    ],
)
def test_build_policy_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        build_policy(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: KeepLast(0), "KeepLast n must be a positive integer, got 0"),
        (lambda: KeepEveryNSteps(-1), "KeepEveryNSteps n must be a positive integer, got -1"),
        (lambda: KeepEverySeconds(0), "KeepEverySeconds t must be a positive number"),
        (lambda: KeepBest("loss", "median"), 'KeepBest mode must be "min" or "max"'),
        (lambda: mark_permanent(10, 0), "keep_every_n_steps must be a positive integer"),
    ],
)
def test_policy_constructor_validation(make, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        make()


def simulate(policy, steps, permanent_every=None, crash_at=(), protected=()):
    """Save one checkpoint per step, running retention after each save."""
    disk: dict[int, CheckpointRecord] = {}
    for step in steps:
        if step in crash_at:
            disk[step] = rec(step, committed=False)
            continue
        disk[step] = rec(
            step,
            permanent=mark_permanent(step, permanent_every),
            metrics={"loss": loss_at(step)},
        )
        for doomed in steps_to_delete(list(disk.values()), policy, protected):
            del disk[doomed]
    return set(disk)


SIM_STEPS = list(range(10, 501, 10))


@pytest.mark.parametrize(
    "policy, permanent_every, crash_at, protected, expected",
    [
        (
            build_policy(keep_last=3, keep_every_n_steps=50),
            None, (), (),
            set(range(50, 501, 50)) | {480, 490, 500},
        ),
        # permanent tier recorded in the manifest, not in the policy
        (
            build_policy(keep_last=3),
            50, (), (),
            set(range(50, 501, 50)) | {480, 490, 500},
        ),
        # torn saves at 120 and 330 are garbage once a later save commits
        (
            build_policy(keep_last=3, keep_every_n_steps=50),
            None, (120, 330), (),
            set(range(50, 501, 50)) | {480, 490, 500},
        ),
        # loss is lowest at 100, then 90/110 tie (newer 110 wins)
        (
            build_policy(keep_last=2, keep_best=("loss", "min", 2)),
            None, (), (),
            {100, 110, 490, 500},
        ),
        # the resumed-from step is protected throughout
        (build_policy(keep_last=2), None, (), (130,), {130, 490, 500}),
    ],
)
def test_simulation_matches_expected(policy, permanent_every, crash_at, protected, expected):
    assert simulate(policy, SIM_STEPS, permanent_every, crash_at, protected) == expected


def test_simulation_random_policies_match_one_shot_result():
    """Incremental deletion after every save ends where one-shot retention would."""
    rng = random.Random(0)
    for _ in range(30):
        keep_last = rng.randint(1, 5)
        every = rng.choice([None, 7, 25, 60])
        best = rng.choice([None, ("loss", "min", rng.randint(1, 3))])
        policy = build_policy(keep_last=keep_last, keep_every_n_steps=every, keep_best=best)
        steps = sorted(rng.sample(range(1, 400), 80))
        survivors = simulate(policy, steps)
        expected = set(steps[-keep_last:])
        if every:
            expected |= {s for s in steps if s % every == 0}
        if best:
            expected |= set(sorted(steps, key=lambda s: (loss_at(s), -s))[: best[2]])
        assert survivors == expected
