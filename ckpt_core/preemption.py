"""Preemption: a signal to any rank becomes a save at the next step boundary on every rank.

The signal handler only sets a flag (async-signal-safe); the decision to stop
is taken at a step boundary, agreed across ranks with one all-reduce, so
every rank saves the same step and no rank enters a collective alone.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Optional, Sequence

log = logging.getLogger("ckpt_core")

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
PREEMPTION_EXIT_CODE = 143
"""Exit code after a preemption save: 128 + SIGTERM, what schedulers expect of a terminated job."""


class Preempted(SystemExit):
    """Raised by ``CheckpointManager.maybe_save`` after the preemption checkpoint is durable."""

    def __init__(self, step: int, signum: int, code: int = PREEMPTION_EXIT_CODE) -> None:
        super().__init__(code)
        self.step = step
        self.signum = signum


class PreemptionWatcher:
    """Installs handlers for ``signals`` that record that a stop was requested."""

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            log.warning("ckpt_core: preemption handlers can only be installed from the main thread; skipped")
            return
        for name in signals:
            sig = getattr(signal, name, None)
            if sig is None:
                raise ValueError(f"unknown signal {name!r} in preemption_signals")
            self._previous[sig] = signal.signal(sig, self._handle)
        self.installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            # a second signal: the sender insists (or training is stuck before a step boundary)
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def uninstall(self) -> None:
        if not self.installed:
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self.installed = False
