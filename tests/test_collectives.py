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


def test_step_flags_are_read_one_step_later_alike_on_every_rank():
    """A flag raised by rank 3 alone at step 2 (a preemption notice reaching one node) is seen by all 4 ranks at
    step 3, and rank 0's clock decides for everyone; the exchange of a step is read at the next."""
    from ckpt_core.collectives import StepFlags

    def loop(g):
        flags, seen = StepFlags(g), []
        for step in range(1, 6):
            agreed = flags.exchange([15 if (g.rank == 3 and step == 2) else 0, int(g.rank == 0 and step == 4)])
            seen.append((step, agreed))
        seen.append(("drain", flags.drain()))
        return seen

    got = run_ranks(4, loop)
    assert got[0] == got[1] == got[2] == got[3]
    assert got[0] == [(1, None), (2, [0, 0]), (3, [15, 0]), (4, [0, 0]), (5, [0, 1]), ("drain", [0, 0])]
