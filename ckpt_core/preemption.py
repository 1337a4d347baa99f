"""Preemption: a signal to any rank becomes a save at the next step boundary on every rank.

The signal handler only sets a flag (async-signal-safe); the decision to stop
is taken at a step boundary, agreed across ranks with one all-reduce, so
every rank saves the same step and no rank enters a collective alone.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
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
    """Records that a stop was requested by one of ``signals``.

    Every watcher of the process shares one handler per signal (``_SignalHub``):
    the first signal reaches every live watcher (each manager saves and exits);
    a second one, while the program is still running (a save that hangs, a
    loop stuck before a step boundary), gets the handler that was there before
    the first watcher, by default the signal's own action: the process ends.
    """

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS) -> None:
        self.signum: Optional[int] = None
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            log.warning("ckpt_core: preemption handlers can only be installed from the main thread; skipped")
            return
        sigs = []
        for name in signals:
            sig = getattr(signal, name, None)
            if sig is None:
                raise ValueError(f"unknown signal {name!r} in preemption_signals")
            sigs.append(sig)
        self._signals = tuple(sigs)
        _HUB.add(self, self._signals)
        self.installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        _HUB._handle(signum, frame)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        _HUB.remove(self)


class _SignalHub(PreemptionWatcher):
    """The one handler per signal that every ``PreemptionWatcher`` of the process shares.

    Each watcher used to install its own handler over the previous one and
    restore it when uninstalled. With several managers in one process (several
    ``Accelerator`` objects, a notebook) that chain broke: the first SIGTERM
    reached only the newest watcher, a second one was handed to an older
    watcher, which took it for a first one (so no number of SIGTERMs ended a
    hung save), a manager dropped without ``close()`` kept swallowing signals
    forever, and closing managers out of order removed another's handler.

    Here the handler is installed once and restored when the last watcher is
    uninstalled (a dropped watcher keeps it installed, as its own handler
    stayed before, so which handler is installed never depends on when the
    garbage collector runs); watchers are held weakly, and a signal that no
    live watcher listens to is passed on at once. The hub is a
    ``PreemptionWatcher`` itself so that code recognising the core's handlers
    by ``handler.__self__`` (the Lightning callback) still does.
    """

    def __init__(self) -> None:  # installs nothing by itself
        self.signum = None
        self.installed = False
        self._previous: dict[int, Any] = {}
        self._registered: dict[int, int] = {}  # watchers installed and not uninstalled, dropped ones included
        self._watchers: dict[int, "weakref.WeakSet[PreemptionWatcher]"] = {}

    def add(self, watcher: PreemptionWatcher, sigs: Sequence[int]) -> None:
        for sig in sigs:
            if signal.getsignal(sig) != self._handle:  # first watcher, or a handler installed over ours
                self._previous[sig] = signal.signal(sig, self._handle)
            self._registered[sig] = self._registered.get(sig, 0) + 1
            self._watchers.setdefault(sig, weakref.WeakSet()).add(watcher)
        self.installed = bool(self._previous)

    def remove(self, watcher: PreemptionWatcher) -> None:
        for sig in getattr(watcher, "_signals", ()):
            self._watchers.get(sig, weakref.WeakSet()).discard(watcher)
            self._registered[sig] = max(self._registered.get(sig, 0) - 1, 0)
            on_main = threading.current_thread() is threading.main_thread()
            if sig in self._previous and self._registered[sig] == 0 and on_main:  # else passed on when it comes
                self._restore(sig)

    def holds(self, sig: int) -> bool:
        """Whether the hub's handler is (still) the one meant for ``sig``: some watcher has not uninstalled."""
        return sig in self._previous

    def _listeners(self, sig: int) -> list[PreemptionWatcher]:
        return [w for w in list(self._watchers.get(sig, ())) if w.installed]

    def _restore(self, sig: int) -> None:
        prev = self._previous.pop(sig)
        self._registered.pop(sig, None)
        signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        if not self._previous:
            self.signum, self.installed = None, False

    def _handle(self, signum: int, frame: Any) -> None:
        listeners = self._listeners(signum)
        if self.signum is not None or not listeners:
            # a second signal (the sender insists, or the program is stuck), or only dropped managers listened
            for sig in list(self._previous):
                self._restore(sig)
            signal.raise_signal(signum)
            return
        self.signum = signum
        for w in listeners:
            if w.signum is None:
                w.signum = signum


_HUB = _SignalHub()
