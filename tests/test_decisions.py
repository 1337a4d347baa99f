""""Save now?" as pure decisions over a context: every clause and its reason."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckpt_core.decisions import GO, SKIP, WAIT, SaveContext, skip_reason, wanted, while_in_flight


def test_nothing_asks_for_a_save():
    assert not wanted(SaveContext(7)) and skip_reason(SaveContext(7)) == "not due"


def test_a_save_in_flight_waits_or_skips_as_set_but_never_skips_a_preemption_save():
    busy = SaveContext(8, due=True, previous_done=False)
    assert while_in_flight(busy) == (WAIT, "on_in_flight='wait'")
    assert while_in_flight(SaveContext(8, due=True, previous_done=False, on_in_flight="skip")) == (
        SKIP, "on_in_flight='skip'")
    action, reason = while_in_flight(SaveContext(8, preempted=True, previous_done=False, on_in_flight="skip"))
    assert action == WAIT and "preempted" in reason
    assert while_in_flight(SaveContext(8, due=True))[0] == GO


def test_a_committed_step_is_not_saved_again():
    assert skip_reason(SaveContext(9, requested=True, committed=True)) == "step 9 is already committed"
    assert skip_reason(SaveContext(9, due=True)) is None


@given(st.integers(0, 10**6), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.sampled_from(["wait", "skip"]), st.booleans())
def test_decisions_are_total_and_consistent(step, due, preempted, requested, done, policy, committed):
    ctx = SaveContext(step, due, preempted, requested, done, policy, committed)
    action, reason = while_in_flight(ctx)
    assert action in (GO, WAIT, SKIP) and reason
    assert (action == GO) == done
    assert action != SKIP or (policy == "skip" and not preempted)
    assert (skip_reason(ctx) is None) == (wanted(ctx) and not committed)
