"""Whether to save now: pure decisions over a ``SaveContext``, one named reason per clause.

The manager gathers the facts every rank agrees on (the schedule's answer by
rank 0's clock, a preemption signal on any rank, whether the previous save
finished everywhere) into a context; these functions decide. Each answer
carries the reason, which the manager logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GO, WAIT, SKIP = "go", "wait", "skip"


@dataclass(frozen=True)
class SaveContext:
    """The facts of one "save now?" question, identical on every rank."""

    step: int
    due: bool = False  # the schedule says so
    preempted: bool = False  # a rank received SIGTERM/SIGUSR1: save, then exit
    requested: bool = False  # an explicit save() call
    previous_done: bool = True  # the previous save finished on every rank
    on_in_flight: str = "wait"  # the setting: "wait" or "skip"
    committed: bool = False  # this step is already committed


def wanted(ctx: SaveContext) -> bool:
    """Whether anything asks for a save at this step (the schedule, a preemption, the caller)."""
    return ctx.due or ctx.preempted or ctx.requested


def while_in_flight(ctx: SaveContext) -> tuple[str, str]:
    """``(GO | WAIT | SKIP, reason)`` for a wanted save while the previous one may still be writing."""
    if ctx.previous_done:
        return GO, "no save in flight"
    if ctx.preempted:
        return WAIT, "preempted: the last checkpoint before exit is never skipped"
    if ctx.on_in_flight == "skip":
        return SKIP, "on_in_flight='skip'"
    return WAIT, "on_in_flight='wait'"


def skip_reason(ctx: SaveContext) -> Optional[str]:
    """Why this step is not saved (once nothing is in flight), or None to save it."""
    if not wanted(ctx):
        return "not due"
    if ctx.committed:
        return f"step {ctx.step} is already committed"
    return None
