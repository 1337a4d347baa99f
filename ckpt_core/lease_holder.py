"""Holding a root's lease (``lease``): take it, refresh it on a thread, notice its loss, release it.

One ``RootLease`` per root per process, shared by every manager of the
process on that root (``hold`` counts them); the last ``release`` ends the
refresh thread and deletes the lease file, so that the next job takes the
root at once instead of waiting for the lease to expire, and a clean run
leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Optional

from . import lease as L

log = logging.getLogger("ckpt_core")

_LOCK = threading.Lock()
_HELD: dict[str, "RootLease"] = {}
_PENDING: "deque[RootLease]" = deque()
"""Leases whose release a finalizer asked for while ``_LOCK`` was taken (``release_later``)."""
_ATTEMPTS = 3


class RootLease:
    """This process's lease on one root."""

    def __init__(self, files: L.LeaseFiles, root: str, run_id: str, source: str, ttl_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.files, self.root, self.ttl_s, self._clock = files, root, ttl_s, clock
        self.claim = L.Claim(run_id, L._PROCESS_TOKEN)
        self.source = source
        self.record: Optional[L.LeaseRecord] = None
        self.lost: Optional[str] = None  # why the lease is no longer ours
        self.users = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lease (``LeaseHeldError`` when another live job holds it) and start refreshing it."""
        for _ in range(_ATTEMPTS):
            current, top, problem = self.files.current()
            now = self._clock()
            if problem is not None:
                action, reason, warn = L.TAKE, f"taking over an unreadable lease ({problem})", True
            else:
                alive = L.holder_alive(current) if current is not None else None
                action, reason, warn = L.decide(current, self.claim, now, alive)
            if action == L.REFUSE:
                raise L.LeaseHeldError(L.refusal(self.root, reason, self.claim, self.ttl_s))
            rec = L.LeaseRecord(run_id=self.claim.run_id, holder=self.claim.holder, host=socket.gethostname(),
                                machine=L.this_machine(), pid=os.getpid(), pid_start=L.process_start(os.getpid()),
                                started=now, refreshed=now, ttl_s=self.ttl_s, generation=top + 1)
            if self.files.create(rec):
                self.record = rec
                (log.warning if warn else log.info)("ckpt_core: lease on %s taken by run %r (%s): %s", self.root,
                                                    rec.run_id, self.source, reason)
                self.files.delete_below(rec.generation)
                self._start_refreshing()
                return
        raise L.LeaseHeldError(f"checkpoint root {self.root}: another job took the lease at the same moment "
                               f"({_ATTEMPTS} tries); give each job its own dirpath")

    def check(self) -> None:
        """``LeaseLostError`` if another job took the lease over."""
        if self.lost is not None:
            raise L.LeaseLostError(f"this job (run {self.claim.run_id!r}) lost the lease on checkpoint root "
                                   f"{self.root}: {self.lost}. It stops saving so that the two jobs do not delete "
                                   "each other's checkpoints; give each job its own dirpath")

    def refresh(self) -> None:
        """Rewrite our generation with the time now, or notice that a newer generation replaced it."""
        assert self.record is not None
        current, top, problem = self.files.current()
        if top != self.record.generation or (current is not None and current.holder != self.record.holder):
            who = current.describe(self._clock()) if current is not None else problem or f"generation {top}"
            self.lost = f"lease generation {top} now belongs to {who}"
            log.error("ckpt_core: lost the lease on %s: %s", self.root, self.lost)
            self._stop.set()
            return
        rec = replace(self.record, refreshed=self._clock())
        self.files.overwrite(rec)
        self.record = rec

    def release(self) -> None:
        """Stop refreshing; delete the lease if it is still ours (a clean end: the next job takes the root at once)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self.record is None or self.lost is not None:
            return
        try:
            current, top, _ = self.files.current()
            if top == self.record.generation and current is not None and current.holder == self.record.holder:
                self.files.delete(self.record.generation)
        except Exception as e:  # noqa: BLE001 - an unreleased lease only delays the next job until it expires
            log.warning("ckpt_core: could not release the lease on %s: %s", self.root, e)

    def _start_refreshing(self) -> None:
        self._thread = threading.Thread(target=self._refresh_loop, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            _drain()
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - storage hiccup: try again next period
                log.warning("ckpt_core: could not refresh the lease on %s: %s", self.root, e)


def hold(fs: Any, root_path: str, root: str, run_id: str, source: str, ttl_s: float) -> RootLease:
    """This process's lease on ``root``, taken if no manager of the process holds it yet; ``release`` it once."""
    key = f"{fs.protocol}://{root_path.rstrip('/')}"
    _drain()
    try:
        with _LOCK:
            held = _HELD.get(key)
            if held is None or held.lost is not None or held.users == 0:
                held = RootLease(L.LeaseFiles(fs, root_path), root, run_id, source, ttl_s)
                held.acquire()
                _HELD[key] = held
            held.users += 1
            return held
    finally:
        _drain()  # what a garbage collection inside asked to release


def release_later(held: RootLease) -> None:
    """``release``, as the finalizer of a dropped manager runs it: the garbage collector may run it on a
    thread that holds ``_LOCK`` (inside ``hold``), where ``release`` would wait for itself forever. Queued,
    and released now when the lock is free, else by the next ``hold``, ``release`` or refresh."""
    _PENDING.append(held)
    if _LOCK.acquire(blocking=False):
        _LOCK.release()
        _drain()


def _drain() -> None:
    while True:
        try:
            held = _PENDING.popleft()
        except IndexError:
            return
        release(held)


def release(held: RootLease) -> None:
    """One user of ``held`` is done; the last one releases the lease."""
    with _LOCK:
        held.users -= 1
        if held.users > 0:
            return
        for key, value in list(_HELD.items()):
            if value is held:
                del _HELD[key]
    held.release()


def release_all() -> None:
    """Release every lease this process holds (interpreter exit, after the last saves were flushed)."""
    _drain()
    with _LOCK:
        held = list(_HELD.values())
        _HELD.clear()
    for h in held:
        h.users = 0
        h.release()
