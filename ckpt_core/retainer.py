"""The retainer: retention and small writes on one background thread of rank 0, never blocking training.

Deleting old checkpoints lists and removes directories on storage, which can
take seconds on an object store; it runs on a worker thread. The side effects
(list the root, delete one checkpoint) are given as arguments, so the decision
path is tested with plain functions.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .errors import is_fatal
from .records import CheckpointInfo
from .retention import RetentionPolicy, records_to_delete

log = logging.getLogger("ckpt_core")


class Retainer:
    """Runs retention after each commit, in order, on one thread; ``wait`` joins what was submitted."""

    def __init__(self, policy: RetentionPolicy, list_records: Callable[[], list[CheckpointInfo]],
                 delete: Callable[[CheckpointInfo], None], active: bool = True) -> None:
        self.policy, self._list, self._delete = policy, list_records, delete
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-retention") if active else None
        self._futures: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker, after what was submitted before (nothing on inactive ranks)."""
        if self._pool is None:
            return
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(fn, *args))

    def retain(self, keep: set[int], protected: Callable[[], set[int]]) -> list[int]:
        """Delete what the policy lets go, never ``keep`` nor ``protected()``; the steps deleted.

        Runs on the worker; a failure is logged, never raised: retention must not break training.
        """
        deleted: list[int] = []
        try:
            for rec in records_to_delete(self._list(), self.policy, keep | protected()):
                self._delete(rec)
                deleted.append(rec.step)
            if deleted:
                log.info("ckpt_core: retention deleted steps %s", deleted)
        except BaseException as e:  # noqa: BLE001 - retention must never break training
            if is_fatal(e):
                raise
            log.warning("ckpt_core: retention failed: %s", e)
        return deleted

    def wait(self) -> None:
        """Block until everything submitted has run (re-raises what a submitted call raised)."""
        for f in list(self._futures):
            f.result()
        self._futures = []

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
