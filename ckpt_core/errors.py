"""What the library does with exceptions from DCP, storage and the files it reads."""

from __future__ import annotations

import traceback
from typing import Iterator


def is_fatal(exc: BaseException) -> bool:
    """Exceptions that stop the program rather than one operation: never caught as a failed save or load.

    DCP's ``CheckpointException`` derives from ``BaseException``; it and any
    other ``BaseException`` mean "this save/load failed", and are handled.
    """
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def describe(exc: BaseException) -> str:
    """One line naming the root cause, unwrapping DCP's per-rank ``CheckpointException``."""
    failures = rank_failures(exc)
    if failures:
        return one_line("; ".join(f"rank {rank}: {type(inner).__name__}: {inner}"
                                  for rank, inner in sorted(failures.items())))
    return one_line(f"{type(exc).__name__}: {exc}")


def rank_failures(exc: BaseException) -> dict:
    """Rank -> the exception it raised, from DCP's ``CheckpointException``; empty for any other exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return {}
    return {rank: err[0] if isinstance(err, tuple) and err else getattr(err, "exc", err)
            for rank, err in failures.items()}


def release_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames ``exc`` holds, through its causes and DCP's per-rank failures.

    For a failure that is handled and not raised (a fallback, a save with ``on_save_error="warn"``).
    A failed DCP call leaves reference cycles between its frames and the exceptions they
    caught; through those frames the state dict being read or written and the manager's
    process groups stay alive until the garbage collector runs. A gloo group still alive at
    interpreter exit can abort the process ("terminate called without an active
    exception"). The traceback's file and line information is kept.
    """
    for e in causes(exc):
        traceback.clear_frames(e.__traceback__)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps, each once: ``cause`` of a ``SaveError``, ``__cause__``/``__context__``, DCP's
    per-rank failures."""
    seen: set[int] = set()
    todo: list = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__, *rank_failures(e).values()]


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) folded into one space."""
    return " ".join(text.split())


class SaveError(RuntimeError):
    """A checkpoint save failed; ``step`` names it and ``__cause__`` says why."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"checkpoint save at step {step} failed: {describe(cause)}")
        self.step, self.cause = step, cause
        self.__cause__ = cause


class RestoreError(RuntimeError):
    """No checkpoint could be restored, or the restored state does not match what was saved."""


class StaleCheckpointError(SaveError):
    """Saves keep failing and the newest committed checkpoint is older than ``max_checkpoint_age_*``.

    Raised instead of another warning with ``on_save_error="warn"`` (``on_stale_checkpoint="raise"``),
    so that a run never goes on unprotected without anyone noticing.
    """

    def __init__(self, step: int, reason: str, last_committed: "int | None", cause: BaseException) -> None:
        since = f"the last committed checkpoint is step {last_committed}" if last_committed is not None else \
            "no checkpoint was committed since the run started"
        RuntimeError.__init__(
            self, f"checkpoint saves keep failing (now at step {step}: {describe(cause)}) and the newest committed "
            f"checkpoint is {reason}; {since}. Fix the storage, or raise the limit (max_checkpoint_age_steps / "
            f"max_checkpoint_age_s), or set on_stale_checkpoint='warn' to go on unprotected")
        self.step, self.reason, self.last_committed = step, reason, last_committed
        self.__cause__ = cause
