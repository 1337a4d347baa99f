"""``CheckpointSettings``: every knob of the checkpointing core, in one validated dataclass.

The Lightning callback, the Accelerate plugin and ``CheckpointManager`` all
build one of these; ``ckpt_core.overrides`` layers environment variables
(``CKPT_<NAME>``) and command-line flags (``--ckpt.<name>``) on top.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

ASYNC_MODES = ("process", "thread", "off")
IN_FLIGHT_POLICIES = ("wait", "skip")
ERROR_POLICIES = ("raise", "warn")
VERIFY_LEVELS = ("none", "size", "checksum")
RESUME_CHECK_POLICIES = ("warn", "raise", "off")


@dataclass
class CheckpointSettings:
    """Settings of one checkpointed run. Construction validates every value.

    Attributes:
        dirpath: checkpoint root, a local path or any fsspec URL (``s3://``, ``memory://``).
        every_n_steps: save when ``step % every_n_steps == 0``.
        every_seconds: save when this many seconds passed since the last save.
        interval: ``"auto"`` for the Young/Daly interval from the measured save cost and MTBF.
        device_mtbf_hours: per-device mean time between failures, for ``interval="auto"``.
        n_devices: devices that fail independently; defaults to the world size.
        min_interval_s / max_interval_s: clamp of the automatic interval.
        keep_last: keep the newest K healthy checkpoints (None keeps all).
        keep_every_n_steps: permanent tier: checkpoints at multiples of N are never deleted.
        keep_every_seconds: keep one checkpoint per window of this many seconds.
        keep_best: ``(metric, "min"|"max", n)``: keep the n best by a metric.
        async_mode: ``process`` (default: DCP's background process), ``thread`` or ``off``.
        on_in_flight: when a save is due while the previous is still writing: ``wait`` or ``skip``.
        on_save_error: a failed background write ``raise``s on the training side or ``warn``s.
        verify: check before loading: ``none``, ``size`` (default) or ``checksum``.
        max_host_memory_bytes: bound on staging memory; larger states save synchronously.
        writer_threads: DCP writer threads (and files) per rank; 4 measured fastest (benchmarks/save.py).
        write_retries: retries of a write that failed with a transient storage error (backoff doubles).
        retry_backoff_s: the first retry's delay in seconds.
        resume: restore the newest valid checkpoint at start.
        resume_step: restore exactly this step (a rollback) instead of the newest.
        resume_check: compare the first losses after a resume with the recorded ones:
            ``warn``, ``raise`` or ``off``.
        resume_check_steps: how many losses after each checkpoint are recorded and compared.
        handle_preemption: on SIGTERM/SIGUSR1, save at the next step boundary and exit.
        preemption_exit_code: the exit code after a preemption save (143 = 128 + SIGTERM).
    """

    dirpath: str = "checkpoints"
    every_n_steps: Optional[int] = None
    every_seconds: Optional[float] = None
    interval: Optional[str] = None
    device_mtbf_hours: Optional[float] = None
    n_devices: Optional[int] = None
    min_interval_s: float = 60.0
    max_interval_s: float = 3600.0
    keep_last: Optional[int] = None
    keep_every_n_steps: Optional[int] = None
    keep_every_seconds: Optional[float] = None
    keep_best: Optional[tuple] = None
    async_mode: str = "process"
    on_in_flight: str = "wait"
    on_save_error: str = "raise"
    verify: str = "size"
    max_host_memory_bytes: Optional[int] = None
    writer_threads: int = 4
    write_retries: int = 3
    retry_backoff_s: float = 0.5
    resume: bool = True
    resume_step: Optional[int] = None
    resume_check: str = "warn"
    resume_check_steps: int = 3
    handle_preemption: bool = True
    preemption_exit_code: int = 143
    storage_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting and what it accepts."""

        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"checkpoint setting {name}={getattr(self, name)!r} is invalid: expected {expected}")

        if not isinstance(self.dirpath, str) or not self.dirpath:
            raise bad("dirpath", "a non-empty path or fsspec URL")
        for name in ("every_n_steps", "keep_last", "keep_every_n_steps", "n_devices", "max_host_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise bad(name, "a positive integer or None")
        if self.resume_step is not None and (not isinstance(self.resume_step, int) or self.resume_step < 0):
            raise bad("resume_step", "an integer >= 0 or None")
        if isinstance(self.resume_check_steps, bool) or not isinstance(self.resume_check_steps, int) or self.resume_check_steps < 0:
            raise bad("resume_check_steps", "an integer >= 0")
        if isinstance(self.preemption_exit_code, bool) or not isinstance(self.preemption_exit_code, int) or not 0 <= self.preemption_exit_code <= 255:
            raise bad("preemption_exit_code", "an integer in [0, 255]")
        if not isinstance(self.handle_preemption, bool):
            raise bad("handle_preemption", "true or false")
        if isinstance(self.write_retries, bool) or not isinstance(self.write_retries, int) or self.write_retries < 0:
            raise bad("write_retries", "an integer >= 0")
        if isinstance(self.retry_backoff_s, bool) or not isinstance(self.retry_backoff_s, (int, float)) or self.retry_backoff_s < 0:
            raise bad("retry_backoff_s", "a number of seconds >= 0")
        if isinstance(self.writer_threads, bool) or not isinstance(self.writer_threads, int) or self.writer_threads < 1:
            raise bad("writer_threads", "an integer >= 1")
        for name in ("every_seconds", "device_mtbf_hours", "keep_every_seconds"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise bad(name, "a positive number of seconds/hours or None")
        for name in ("min_interval_s", "max_interval_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(name, "a positive number of seconds")
        if self.min_interval_s > self.max_interval_s:
            raise bad("min_interval_s", f"at most max_interval_s={self.max_interval_s}")
        if self.interval not in (None, "auto"):
            raise bad("interval", "'auto' or None")
        if self.interval == "auto" and self.device_mtbf_hours is None:
            raise bad("device_mtbf_hours", "a number of hours when interval='auto'")
        for name, allowed in (
            ("async_mode", ASYNC_MODES),
            ("on_in_flight", IN_FLIGHT_POLICIES),
            ("on_save_error", ERROR_POLICIES),
            ("verify", VERIFY_LEVELS),
            ("resume_check", RESUME_CHECK_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise bad(name, f"one of {', '.join(allowed)}")
        if self.keep_best is not None:
            kb = self.keep_best
            if not (isinstance(kb, (tuple, list)) and len(kb) == 3 and isinstance(kb[0], str)
                    and kb[1] in ("min", "max") and isinstance(kb[2], int) and kb[2] > 0):
                raise bad("keep_best", "(metric, 'min'|'max', n) with n a positive integer")
            self.keep_best = tuple(kb)
        if not isinstance(self.resume, bool):
            raise bad("resume", "true or false")

    def replace(self, **changes: Any) -> "CheckpointSettings":
        return dataclasses.replace(self, **changes)


def setting_names() -> list[str]:
    return [f.name for f in dataclasses.fields(CheckpointSettings)]
