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


def checkpoint_too_old(age_steps: int, age_s: float, max_age_steps: Optional[int],
                       max_age_s: Optional[float]) -> Optional[str]:
    """Why the newest committed checkpoint is too old (a limit is passed), or None.

    ``age_steps``/``age_s``: steps and seconds since the newest committed
    checkpoint (or since the run started, when it has none); a limit of None
    is off. Strictly older than the limit: a checkpoint exactly at the limit is fine.
    """
    if max_age_steps is not None and age_steps > max_age_steps:
        return f"{age_steps} steps old, more than max_checkpoint_age_steps={max_age_steps}"
    if max_age_s is not None and age_s > max_age_s:
        return f"{age_s:.0f}s old, more than max_checkpoint_age_s={max_age_s:g}"
    return None


def on_stale(too_old: Optional[str], failed_saves: int, on_save_error: str, on_stale_checkpoint: str) -> Optional[str]:
    """What a save attempt does about the age of the newest checkpoint: ``"raise"``, ``"warn"`` or None.

    Only a run whose last save failed while failures only warn (``on_save_error="warn"``)
    is at stake: with ``"raise"`` the failure itself stopped it, and a run whose saves
    commit is protected.
    """
    if too_old is None or failed_saves <= 0 or on_save_error != "warn":
        return None
    return on_stale_checkpoint
