"""Which checkpoints to keep and which directories to delete.

Policies are composable, in the spirit of Orbax's preservation policies: each
policy names the steps it wants to keep, and a checkpoint survives if ANY
policy keeps it. Everything here is pure: it works on ``CheckpointRecord``
values and returns step numbers; the caller does the deleting.
"""

from __future__ import annotations

import math
from typing import Iterable, Protocol, Sequence

from ckpt_core.config.schema import check_values
from ckpt_core.records import CheckpointRecord

__all__ = [
    "RetentionPolicy",
    "Policy",
    "KeepAll",
    "KeepLast",
    "KeepEveryNSteps",
    "KeepEverySeconds",
    "KeepBest",
    "KeepPermanent",
    "AnyOf",
    "build_policy",
    "records_to_delete",
    "steps_to_delete",
    "mark_permanent",
]


class RetentionPolicy(Protocol):
    """Anything that can say which of the given committed records to keep."""

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        """Return the steps to keep among ``records`` (all committed)."""
        ...


class Policy:
    """Base class for the built-in policies; adds ``a | b`` composition."""

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        raise NotImplementedError

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf(self, other)


def _check_positive_int(value: object, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        or_none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a positive integer{or_none}, got {value!r}")


def _check_positive_number(value: object, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )
    if not ok:
        or_none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a positive number of seconds{or_none}, got {value!r}")


class KeepAll(Policy):
    """Keep every checkpoint (what ``keep_last=None`` means)."""

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        return {r.step for r in records}

    def __repr__(self) -> str:
        return "KeepAll()"


class KeepLast(Policy):
    """Keep the ``n`` newest healthy checkpoints.

    Unhealthy checkpoints (non-finite state when saved) never count toward the
    ``n``, so they cannot push good checkpoints out. Unhealthy checkpoints newer
    than the newest healthy one are also kept, so the most recent evidence of
    corruption is not destroyed immediately; at most ``n`` of them, so a run
    that keeps saving non-finite state cannot fill the disk.
    """

    def __init__(self, n: int) -> None:
        _check_positive_int(n, "KeepLast n")
        self.n = n

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        healthy = sorted((r.step for r in records if r.healthy), reverse=True)
        newest_healthy = healthy[0] if healthy else None
        evidence = sorted(
            (
                r.step
                for r in records
                if not r.healthy and (newest_healthy is None or r.step > newest_healthy)
            ),
            reverse=True,
        )
        return set(healthy[: self.n]) | set(evidence[: self.n])

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


class KeepEveryNSteps(Policy):
    """Keep steps divisible by ``n``: the long-lived, permanent tier."""

    def __init__(self, n: int) -> None:
        _check_positive_int(n, "KeepEveryNSteps n")
        self.n = n

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        return {r.step for r in records if r.step % self.n == 0}

    def __repr__(self) -> str:
        return f"KeepEveryNSteps({self.n})"


class KeepEverySeconds(Policy):
    """Keep the first checkpoint in each ``t``-second window of ``wall_time``.

    Windows are ``floor(wall_time / t)``; "first" is the earliest wall time,
    ties broken by the lower step. Because the first of a window is always
    kept, the choice is stable as later checkpoints come and go.
    """

    def __init__(self, t: float) -> None:
        _check_positive_number(t, "KeepEverySeconds t")
        self.t = t

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        first: dict[int, CheckpointRecord] = {}
        for r in records:
            window = math.floor(r.wall_time / self.t)
            best = first.get(window)
            if best is None or (r.wall_time, r.step) < (best.wall_time, best.step):
                first[window] = r
        return {r.step for r in first.values()}

    def __repr__(self) -> str:
        return f"KeepEverySeconds({self.t})"


class KeepBest(Policy):
    """Keep the ``n`` best healthy checkpoints by ``metrics[metric]``.

    Records without the metric, with a NaN value, or unhealthy are ignored.
    On equal values the newer checkpoint wins.
    """

    def __init__(self, metric: str, mode: str = "min", n: int = 1) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"KeepBest metric must be a non-empty metric name, got {metric!r}")
        if mode not in ("min", "max"):
            raise ValueError(f'KeepBest mode must be "min" or "max", got {mode!r}')
        _check_positive_int(n, "KeepBest n")
        self.metric = metric
        self.mode = mode
        self.n = n

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        scored = []
        for r in records:
            value = r.metrics.get(self.metric)
            if r.healthy and value is not None and not math.isnan(value):
                scored.append((value if self.mode == "min" else -value, -r.step))
        scored.sort()
        return {-neg_step for _, neg_step in scored[: self.n]}

    def __repr__(self) -> str:
        return f"KeepBest({self.metric!r}, {self.mode!r}, {self.n})"


class KeepPermanent(Policy):
    """Keep checkpoints whose manifest marks them ``permanent``."""

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        return {r.step for r in records if r.permanent}

    def __repr__(self) -> str:
        return "KeepPermanent()"


class AnyOf(Policy):
    """Union of policies: keep a step if any member keeps it."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies: tuple[RetentionPolicy, ...] = policies

    def keep(self, records: Sequence[CheckpointRecord]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(records)
        return kept

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf(*self.policies, other)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


def build_policy(
    keep_last: int | None = None,
    keep_every_n_steps: int | None = None,
    keep_every_seconds: float | None = None,
    keep_best: tuple[str, str, int] | None = None,
) -> RetentionPolicy:
    """Build the policy for the user-facing keep_* options.

    ``KeepPermanent`` is always included. ``keep_last=None`` keeps everything.
    Invalid arguments raise ``SettingError`` (a ``ValueError``) naming the setting and what it accepts.
    """
    check_values(keep_last=keep_last, keep_every_n_steps=keep_every_n_steps,
                 keep_every_seconds=keep_every_seconds, keep_best=keep_best)

    if keep_last is None:
        return AnyOf(KeepPermanent(), KeepAll())
    policies: list[RetentionPolicy] = [KeepPermanent(), KeepLast(keep_last)]
    if keep_every_n_steps is not None:
        policies.append(KeepEveryNSteps(keep_every_n_steps))
    if keep_every_seconds is not None:
        policies.append(KeepEverySeconds(keep_every_seconds))
    if keep_best is not None:
        policies.append(KeepBest(*keep_best))
    return AnyOf(*policies)


def records_to_delete(
    records: Sequence[CheckpointRecord],
    policy: RetentionPolicy,
    protected: Iterable[int] = (),
) -> list[CheckpointRecord]:
    """Return the checkpoint directories to delete, oldest first.

    ``records`` may include uncommitted (torn or in-progress) directories.
    Never deleted: the newest committed checkpoint, the newest committed
    healthy checkpoint, permanent ones, and ``protected`` steps (e.g. the step
    the run resumed from, or an in-flight save). Committed checkpoints the
    policy does not keep are deleted. Uncommitted directories are deleted only
    when their label is older than the newest committed checkpoint (crash
    garbage); newer ones may be a save in progress and are left alone. A
    directory whose manifest could not be read (``unreadable``) may be
    committed and is never deleted. With no committed checkpoint at all,
    nothing is deleted.
    """
    committed = [r for r in records if r.committed]
    if not committed:
        return []
    newest = max(r.step for r in committed)
    keep = set(protected) | {newest} | policy.keep(committed)
    keep |= {r.step for r in committed if r.permanent}
    healthy = [r.step for r in committed if r.healthy]
    if healthy:
        keep.add(max(healthy))
    doomed = [r for r in records
              if r.step not in keep and not r.unreadable and (r.committed or r.step < newest)]
    return sorted(doomed, key=lambda r: (r.step, r.path))


def steps_to_delete(
    records: Sequence[CheckpointRecord],
    policy: RetentionPolicy,
    protected: Iterable[int] = (),
) -> list[int]:
    """The steps of ``records_to_delete``, ascending and without repeats."""
    return sorted({r.step for r in records_to_delete(records, policy, protected)})


def mark_permanent(step: int, keep_every_n_steps: int | None) -> bool:
    """Whether a checkpoint saved at ``step`` belongs in the permanent tier.

    Used at save time so the manifest records ``permanent`` and the choice
    survives later changes to the retention options.
    """
    if keep_every_n_steps is None:
        return False
    _check_positive_int(keep_every_n_steps, "keep_every_n_steps", allow_none=True)
    return step % keep_every_n_steps == 0
