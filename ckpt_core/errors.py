"""What the library does with exceptions from DCP, storage and the files it reads."""

from __future__ import annotations


def is_fatal(exc: BaseException) -> bool:
    """Exceptions that stop the program rather than one operation: never caught as a failed save or load.

    DCP's ``CheckpointException`` derives from ``BaseException``; it and any
    other ``BaseException`` mean "this save/load failed", and are handled.
    """
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def describe(exc: BaseException) -> str:
    """One line naming the root cause, unwrapping DCP's per-rank ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, err in sorted(failures.items()):
            inner = err[0] if isinstance(err, tuple) and err else getattr(err, "exc", err)
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return one_line("; ".join(parts))
    return one_line(f"{type(exc).__name__}: {exc}")


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) folded into one space."""
    return " ".join(text.split())


class SaveError(RuntimeError):
    """A checkpoint save failed; ``step`` names it and ``__cause__`` says why."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"checkpoint save at step {step} failed: {describe(cause)}")
        self.step = step
        self.__cause__ = cause


class RestoreError(RuntimeError):
    """No checkpoint could be restored, or the restored state does not match what was saved."""
