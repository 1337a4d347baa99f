"""How often to save: checkpoint-interval math and the "save now?" decision.

Everything here is pure. ``SaveSchedule`` decides from plain values that the
caller has made identical on every rank; it never reads a clock itself, so
ranks cannot disagree about whether a collective save starts.

Interval model: with blocking save cost ``C`` and mean time between failures
``M`` of the whole job, Young (1974) gives ``sqrt(2CM)``; Daly (2006) adds
higher-order terms, which matter once ``C`` is not small next to ``M``. An
asynchronous save keeps writing after the loop resumed: ``W``, the time from
its dispatch to its commit, is a floor of the interval (a shorter one only
makes saves queue) and a lag in the expected loss (``expected_overhead``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Optional

from .config.schema import check_values

__all__ = [
    "cluster_mtbf_seconds",
    "young_interval",
    "daly_interval",
    "optimal_interval",
    "expected_overhead",
    "SaveSchedule",
]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _positive(value: object, name: str) -> None:
    _require(_is_number(value) and value > 0, f"{name} must be a positive number, got {value!r}")


def _non_negative(value: object, name: str) -> None:
    _require(_is_number(value) and value >= 0, f"{name} must be a number >= 0, got {value!r}")


def _positive_int(value: object, name: str) -> None:
    _require(
        not isinstance(value, bool) and isinstance(value, int) and value > 0,
        f"{name} must be a positive integer, got {value!r}",
    )


def cluster_mtbf_seconds(device_mtbf_hours: float, n_devices: int) -> float:
    """Job-level MTBF in seconds, assuming independent device failures.

    Any one device failing stops the job, so MTBF shrinks linearly with the
    device count: 1000 h per device over 10,000 devices is 360 s.
    """
    _positive(device_mtbf_hours, "device_mtbf_hours")
    _positive_int(n_devices, "n_devices")
    return device_mtbf_hours * 3600.0 / n_devices


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal interval ``sqrt(2 C M)`` in seconds."""
    _non_negative(cost_s, "cost_s")
    _positive(mtbf_s, "mtbf_s")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimal interval in seconds.

    For ``C < 2M``: ``sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C``;
    otherwise ``M`` (saving more often than failures arrive does not pay).
    Reduces to Young's ``sqrt(2CM)`` when ``C << M``.
    """
    _non_negative(cost_s, "cost_s")
    _positive(mtbf_s, "mtbf_s")
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def optimal_interval(
    cost_s: float, mtbf_s: float, min_interval: float, max_interval: float, write_s: float = 0.0
) -> float:
    """Daly's interval clamped to ``[min_interval, max_interval]`` seconds, then never below ``write_s``.

    ``write_s`` is the background write time ``W`` (dispatch to commit). Saves
    closer together than ``W`` queue: the next one waits for the previous one
    to commit, stalling the loop, and no checkpoint commits sooner. So ``W``
    wins over ``max_interval`` too. ``expected_overhead`` is convex in the
    interval, so ``max(optimum, W)`` is the best interval of at least ``W``.
    """
    _positive(min_interval, "min_interval")
    _positive(max_interval, "max_interval")
    _non_negative(write_s, "write_s")
    _require(
        min_interval <= max_interval,
        f"min_interval ({min_interval}) must be <= max_interval ({max_interval})",
    )
    return max(min(max(daly_interval(cost_s, mtbf_s), min_interval), max_interval), write_s)


def expected_overhead(
    interval_s: float, cost_s: float, mtbf_s: float, write_s: float = 0.0, restart_s: float = 0.0
) -> float:
    """Expected fraction of wall time lost to checkpointing and failures.

    First-order model, interval ``tau``, stall ``C`` per save, commit lag
    ``W`` (dispatch to commit), restart ``R``, job MTBF ``M``:

    - ``C/tau`` is time the loop spends stalled in saves;
    - saves are dispatched every ``P = tau + C``, and the one dispatched at
      ``t`` protects the work up to ``t`` only from ``t + W`` on. A failure
      at a uniformly random moment loses the work since the newest
      *committed* checkpoint: ``P/2 + W`` on average (for any ``W``), plus
      the restart ``R``. Failures come at rate ``1/M``.

    Overhead: ``C/tau + ((tau + C)/2 + W + R)/M``, capped at 1.0. ``W`` and
    ``R`` only add the constant ``(W + R)/M``: the optimum is still Young's
    ``sqrt(2CM)`` to first order (Daly's to higher order), and ``W`` enters
    the interval only as its floor (``optimal_interval``).
    """
    _positive(interval_s, "interval_s")
    _non_negative(cost_s, "cost_s")
    _positive(mtbf_s, "mtbf_s")
    _non_negative(write_s, "write_s")
    _non_negative(restart_s, "restart_s")
    lost_per_failure = (interval_s + cost_s) / 2.0 + write_s + restart_s
    return min(1.0, cost_s / interval_s + lost_per_failure / mtbf_s)


class SaveSchedule:
    """Decides "save now?" from rank-synchronized inputs.

    Triggers (any one firing means save):

    - ``every_n_steps``: ``step > 0 and step % every_n_steps == 0``.
    - ``every_seconds``: ``elapsed_s >= every_seconds``.
    - ``interval="auto"``: ``elapsed_s >= interval_s``, where ``interval_s`` is
      Daly's interval from the measured save cost (``record_cost``: the stall,
      waiting for the previous save included) and the job MTBF
      (``device_mtbf_hours`` over ``n_devices``), clamped to
      ``[min_interval_s, max_interval_s]``, and never below the measured
      background write time (``record_write``), which wins over
      ``max_interval_s`` (``optimal_interval``).

    With no trigger configured it never saves automatically.

    The time triggers must answer alike on every rank, or one rank would
    enter a collective save alone and hang: either every rank's schedule gets
    identical ``elapsed_s``, costs and write times, or one rank's schedule
    decides and its answer is broadcast. ``CheckpointManager`` does the
    latter: rank 0's schedule, fed rank 0's clock and rank 0's measurements,
    raises the time flag that ``collectives.StepFlags`` shares. Feeding each
    rank's schedule its local clock and deciding locally lets ranks disagree.
    ``needs_time_sync`` tells the caller whether that exchange is needed.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        interval: str | None = None,
        device_mtbf_hours: float | None = None,
        n_devices: int = 1,
        min_interval_s: float = 60.0,
        max_interval_s: float = 3600.0,
        cost_window: int = 5,
        initial_cost_s: float | None = None,
    ) -> None:
        check_values(every_n_steps=every_n_steps, every_seconds=every_seconds, interval=interval,
                     device_mtbf_hours=device_mtbf_hours, n_devices=n_devices, min_interval_s=min_interval_s,
                     max_interval_s=max_interval_s)
        _positive_int(cost_window, "cost_window")
        if initial_cost_s is not None:
            _non_negative(initial_cost_s, "initial_cost_s")

        self.every_n_steps = every_n_steps
        self.every_seconds = every_seconds
        self.auto = interval == "auto"
        self.device_mtbf_hours = device_mtbf_hours
        self.n_devices = n_devices
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.initial_cost_s = initial_cost_s
        self._costs: deque[float] = deque(maxlen=cost_window)
        self._writes: deque[float] = deque(maxlen=cost_window)

    def record_cost(self, blocking_s: float) -> None:
        """Add a measured save cost ``C``: seconds the loop stalled for one save.

        That is the wait for the previous save to finish writing (when it was
        still in flight) plus the dispatch. The cost used is the median of the
        last ``cost_window`` measurements, so one slow save does not swing the
        interval.
        """
        _non_negative(blocking_s, "blocking_s")
        self._costs.append(float(blocking_s))

    def record_write(self, write_s: float) -> None:
        """Add a committed save's write time ``W``: seconds from its dispatch to its commit.

        The floor of the auto interval is the median of the last
        ``cost_window`` measurements (``write_s``).
        """
        _non_negative(write_s, "write_s")
        self._writes.append(float(write_s))

    @property
    def cost_s(self) -> Optional[float]:
        """Moving median of recent costs, else ``initial_cost_s``, else None."""
        if self._costs:
            return statistics.median(self._costs)
        return self.initial_cost_s

    @property
    def write_s(self) -> Optional[float]:
        """Moving median of recent write times, else None."""
        return statistics.median(self._writes) if self._writes else None

    @property
    def write_bound(self) -> bool:
        """Whether the write time holds the auto interval above ``max_interval_s``."""
        write = self.write_s
        return self.auto and write is not None and write > self.max_interval_s

    @property
    def mtbf_s(self) -> Optional[float]:
        """Job MTBF in seconds, or None without ``device_mtbf_hours``."""
        if self.device_mtbf_hours is None:
            return None
        return cluster_mtbf_seconds(self.device_mtbf_hours, self.n_devices)

    @property
    def interval_s(self) -> Optional[float]:
        """Current time interval: auto's, else ``every_seconds``, else None.

        Before any cost is known (no measurement, no ``initial_cost_s``) the
        auto interval is ``min_interval_s`` (or the write time, if longer), so
        a first save happens early and its cost gets measured.
        """
        if self.auto:
            cost, mtbf, write = self.cost_s, self.mtbf_s, self.write_s or 0.0
            if cost is None or mtbf is None:
                return max(self.min_interval_s, write)
            return optimal_interval(cost, mtbf, self.min_interval_s, self.max_interval_s, write)
        return self.every_seconds

    @property
    def expected_overhead(self) -> Optional[float]:
        """Expected lost-time fraction at the auto interval; None if not auto or no cost."""
        cost, interval, mtbf = self.cost_s, self.interval_s, self.mtbf_s
        if not self.auto or cost is None or interval is None or mtbf is None:
            return None
        return expected_overhead(interval, cost, mtbf, self.write_s or 0.0)

    @property
    def needs_time_sync(self) -> bool:
        """True when a time-based trigger is configured (broadcast the clock)."""
        return self.auto or self.every_seconds is not None

    def should_save(self, step: int, elapsed_s: float) -> bool:
        """Whether to save at ``step``.

        ``elapsed_s`` is seconds since the last save (or start), as agreed
        across ranks; never pass a rank-local clock reading.
        """
        return self.step_due(step) or self.time_due(elapsed_s)

    def step_due(self, step: int) -> bool:
        """The step trigger alone: the same on every rank, no clock involved."""
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0

    def time_due(self, elapsed_s: float) -> bool:
        """The time triggers alone (``every_seconds``, ``auto``): one rank's clock must decide for all."""
        _non_negative(elapsed_s, "elapsed_s")
        if self.every_seconds is not None and elapsed_s >= self.every_seconds:
            return True
        interval = self.interval_s if self.auto else None
        return interval is not None and elapsed_s >= interval

    def describe(self) -> dict[str, Any]:
        """Current interval, cost, write time, MTBF and expected overhead, for logging."""
        return {
            "interval_s": self.interval_s,
            "cost_s": self.cost_s,
            "write_s": self.write_s,
            "mtbf_s": self.mtbf_s,
            "expected_overhead": self.expected_overhead,
        }
