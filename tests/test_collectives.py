"""The ranks' shared decisions, at 4 ranks on threads over fake groups that check every collective lines up."""

from __future__ import annotations

import threading

import pytest

from ckpt_core.collectives import (
    CollectiveMismatch,
    CollectiveTimeout,
    TorchRankGroup,
    all_done,
    first_problem,
    run_ranks,
)


def test_first_problem_is_the_lowest_rank_s_on_every_rank():
    problems = {2: ("corrupt", "bad crc in __2_0.distcp"), 3: ("missing", "no __3_0.distcp")}
    got = run_ranks(4, lambda g: first_problem(g, problems.get(g.rank)))
    assert got[2] == ("corrupt", "bad crc in __2_0.distcp")
    assert got[0] == got[1] == got[3] == ("corrupt", "rank 2: bad crc in __2_0.distcp")
    assert run_ranks(4, lambda g: first_problem(g, None)) == [None] * 4


def test_done_everywhere_only_when_done_on_every_rank():
    assert run_ranks(4, lambda g: all_done(g, g.rank != 2)) == [False] * 4
    assert run_ranks(4, lambda g: all_done(g, True)) == [True] * 4


def test_a_rank_local_test_in_front_of_an_agreement_is_caught():
    """The bug that hangs real jobs: a rank whose own save finished skips the agreement the others enter."""

    def save(g):
        own_save_done = g.rank == 1
        if not own_save_done:  # wrong: every rank must take part
            all_done(g, False)
        return g.broadcast("path" if g.rank == 0 else None)

    with pytest.raises(CollectiveMismatch) as info:
        run_ranks(4, save, timeout_s=5)
    msg = str(info.value)
    assert "all_min" in msg and "broadcast(src=0)" in msg
    assert msg.count("test_collectives.py:") == 2  # both call sites, by file and line


def test_different_groups_and_orders_are_caught():
    def groups(g):
        ctl = g.subgroup("ctl")
        return (ctl if g.rank == 3 else g).all_min(1)

    with pytest.raises(CollectiveMismatch, match="group 'default'.*group 'ctl'"):
        run_ranks(4, groups, timeout_s=5)

    def order(g):
        if g.rank % 2:
            return g.all_max(1), g.all_min(1)
        return g.all_min(1), g.all_max(1)

    with pytest.raises(CollectiveMismatch, match="all_min.*all_max|all_max.*all_min"):
        run_ranks(4, order, timeout_s=5)


def test_a_rank_that_returns_while_others_wait_is_caught():
    with pytest.raises(CollectiveMismatch, match="rank 3 returned"):
        run_ranks(4, lambda g: None if g.rank == 3 else all_done(g, True), timeout_s=5)


def test_a_collective_that_never_completes_times_out_naming_the_waiters():
    never = threading.Event()

    def stuck(g):
        if g.rank == 2:
            never.wait(3)  # busy elsewhere, not in a collective
        return all_done(g, True)

    with pytest.raises(CollectiveTimeout, match="rank 0 at test_collectives.py"):
        run_ranks(4, stuck, timeout_s=0.5)


def test_one_process_answers_locally():
    g = TorchRankGroup(enabled=False)
    assert (g.rank, g.world_size) == (0, 1)
    assert all_done(g, False) is False and g.start_all_max([3, 0])() == [3, 0]
    assert first_problem(g, ("k", "m")) == ("k", "m")


def _flag_loop(g, calls: int, raise_at: int, step_s: float, **kwargs) -> list:
    """``calls`` maybe_save-like calls of ``step_s`` each (a fake clock): rank 3 alone raises 15 at ``raise_at``,
    rank 0's clock says "due" at call 4; what each call read, and the collectives issued."""
    from ckpt_core.collectives import StepFlags

    now = [0.0]
    flags, seen = StepFlags(g, clock=lambda: now[0], **kwargs), []
    for call in range(1, calls + 1):
        now[0] += step_s
        seen.append((call, flags.begin(), flags.every))
        flags.end(lambda: [15 if (g.rank == 3 and call >= raise_at) else 0, int(g.rank == 0 and call == 4)])
    seen.append(("drain", flags.drain()))
    return seen


def test_step_flags_of_long_steps_are_read_one_step_later_alike_on_every_rank():
    """Steps longer than the 20 ms target exchange at every call: a flag raised by rank 3 alone at call 2 (a
    preemption notice reaching one node) is seen by all 4 ranks at call 3; rank 0's clock decides for everyone."""
    got = run_ranks(4, lambda g: _flag_loop(g, 5, raise_at=2, step_s=0.05))
    assert got[0] == got[1] == got[2] == got[3]
    assert got[0] == [(1, None, 1), (2, [0, 0], 1), (3, [15, 0], 1), (4, [15, 0], 1), (5, [15, 1], 1),
                      ("drain", [15, 0, 1])]


def test_step_flags_of_short_steps_exchange_every_few_calls_and_agree_on_the_call():
    """2 ms steps: rank 0 proposes an exchange every 8th call (20 ms would be 10; 8 is the bound), every rank adopts
    it at the same call, and a flag raised by one rank is read by all at one call, at most 2 x 8 calls later."""
    got = run_ranks(4, lambda g: _flag_loop(g, 60, raise_at=25, step_s=0.002))
    assert got[0] == got[1] == got[2] == got[3]
    reads = [(call, agreed, every) for call, agreed, every in got[0][:-1] if agreed is not None]
    # calls 1 and 2 exchange at every call; call 2 measures 2 ms a call and proposes 8, read at call 3
    assert [(call, every) for call, _, every in reads] == [(2, 1), (3, 8), (11, 8), (19, 8), (27, 8), (35, 8),
                                                           (43, 8), (51, 8), (59, 8)]
    first_seen = min(call for call, agreed, _ in reads if agreed[0] == 15)
    assert first_seen == 35 and first_seen - 25 <= 2 * 8  # raised at 25, sent at the exchange of call 27


def test_step_flags_issue_one_collective_per_exchange_only():
    """Between exchanges a call issues no collective: the hub sees one start_all_max per exchange call."""
    def loop(g):
        issued = [0]
        real = g.start_all_max

        def counting(values):
            issued[0] += 1
            return real(values)

        g.start_all_max = counting
        _flag_loop(g, 60, raise_at=100, step_s=0.002)
        return issued[0]

    assert run_ranks(4, loop) == [10, 10, 10, 10]  # calls 1, 2, 3, 11, 19, 27, 35, 43, 51, 59 of 60


@pytest.mark.parametrize("interval, expected", [(0.05, 1), (0.02, 1), (0.019, 2), (0.005, 4), (0.002, 8),
                                                (0.0001, 8), (0.0, 8)])
def test_exchange_every(interval, expected):
    from ckpt_core.collectives import exchange_every

    assert exchange_every(interval, 0.02, 8) == expected


