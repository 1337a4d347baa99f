"""The retainer with its side effects given as plain functions: what it deletes, what it never deletes."""

from __future__ import annotations

import logging
import threading

from ckpt_core.records import CheckpointRecord
from ckpt_core.retainer import Retainer
from ckpt_core.retention import KeepLast


def recs(*steps: int) -> list[CheckpointRecord]:
    return [CheckpointRecord(step=s, path=f"root/step_{s}", committed=True) for s in steps]


def test_deletes_what_the_policy_lets_go_but_never_the_protected():
    deleted = []
    r = Retainer(KeepLast(1), lambda: recs(10, 20, 30, 40), lambda rec: deleted.append(rec.path))
    assert r.retain({40}, lambda: {20}) == [10, 30]  # 20: the run resumed from it (or it is in flight)
    assert deleted == ["root/step_10", "root/step_30"]
    r.shutdown()


def test_a_failing_delete_is_logged_never_raised(caplog):
    def delete(rec):
        if rec.step == 20:
            raise PermissionError("read-only bucket")

    r = Retainer(KeepLast(1), lambda: recs(10, 20, 30), delete)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        assert r.retain({30}, set) == [10]
    assert "retention failed: read-only bucket" in caplog.text
    r.shutdown()


def test_submitted_work_runs_in_order_on_one_thread_and_wait_joins_it():
    seen, threads = [], set()
    gate = threading.Event()
    r = Retainer(KeepLast(1), list, lambda rec: None)

    def job(i):
        gate.wait(5)
        seen.append(i)
        threads.add(threading.current_thread().name)

    for i in range(5):
        r.submit(job, i)
    assert seen == []  # training is not blocked
    gate.set()
    r.wait()
    assert seen == [0, 1, 2, 3, 4] and len(threads) == 1 and threads.pop().startswith("ckpt-retention")
    r.shutdown()


def test_inactive_on_other_ranks():
    r = Retainer(KeepLast(1), lambda: recs(1, 2), lambda rec: None, active=False)
    r.submit(lambda: 1 / 0)
    r.wait()
    r.shutdown()
