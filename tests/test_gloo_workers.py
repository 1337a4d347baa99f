"""gloo's worker threads release their last collective before interpreter finalization (``gloo_workers``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, WORKERS, run_script
from ckpt_core import gloo_workers

WORKER = WORKERS / "late_release_worker.py"


def _run_alone(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "ignore", str(WORKER), *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                                      "PATH": "/usr/bin:/bin"})


def test_a_collective_released_after_the_script_ends_aborts_the_process_without_the_library():
    """The failure the exit hook prevents: gloo's worker frees the all-gather's tensors during finalization."""
    proc = _run_alone()
    assert "end of script" in proc.stdout
    assert proc.returncode == -signal.SIGABRT, proc.stderr[-2000:]
    assert "terminate called without an active exception" in proc.stderr


def test_the_library_lets_gloo_release_it_before_finalization():
    proc = _run_alone("--with-library")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "end of script" in proc.stdout and "terminate called" not in proc.stderr


def test_every_rank_of_4_exits_cleanly():
    proc = run_script(WORKER, ["--with-library"], nproc=4, env={"PYTHONWARNINGS": "ignore"})
    assert "terminate called" not in proc.stderr


def _samples(*states: dict):
    it = iter(states)
    return lambda: next(it)


@pytest.mark.parametrize("before,after,idle", [
    ({"7": ("S", 10)}, {"7": ("S", 10)}, True),
    ({"7": ("S", 10)}, {"7": ("S", 11)}, False),  # woke in between: it may be taking the GIL
    ({"7": ("R", 10)}, {"7": ("R", 10)}, False),  # runnable, not yet scheduled
    ({"7": ("S", 10), "8": ("S", 3)}, {"7": ("S", 10)}, True),  # a thread that ended is no longer waited for
    ({"7": ("S", 10)}, {"7": ("S", 10), "9": ("S", 0)}, False),  # a new worker: sample it once more
])
def test_is_idle(before, after, idle):
    assert gloo_workers.is_idle(before, after) is idle


def test_wait_until_idle_returns_once_two_samples_agree(monkeypatch):
    seq = _samples({"7": ("R", 1)}, {"7": ("S", 2)}, {"7": ("S", 2)})
    monkeypatch.setattr(gloo_workers, "workers", seq)
    assert gloo_workers.wait_until_idle(timeout_s=5, poll_s=0) is True


def test_wait_until_idle_gives_up_at_the_timeout(monkeypatch):
    counter = iter(range(10**6))
    monkeypatch.setattr(gloo_workers, "workers", lambda: {"7": ("S", next(counter))})
    assert gloo_workers.wait_until_idle(timeout_s=0.05, poll_s=0.001) is False


def test_no_gloo_worker_means_no_wait(monkeypatch):
    monkeypatch.setattr(gloo_workers, "workers", dict)
    monkeypatch.setattr(gloo_workers.time, "sleep", lambda s: pytest.fail("slept with no worker to wait for"))
    assert gloo_workers.wait_until_idle() is True


def test_workers_finds_the_threads_of_a_live_gloo_group():
    """A gloo backend of its own (the default group may belong to another test of this process)."""
    import torch.distributed as dist

    others = set(gloo_workers.workers())  # groups other tests of this process left
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    deadline = time.monotonic() + 10
    while True:  # each worker names itself once it runs
        found = {tid: s for tid, s in gloo_workers.workers().items() if tid not in others}
        if len(found) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(found) == 2 and all(state in "SR" for state, _ in found.values())  # gloo's 2 default workers
    assert gloo_workers.wait_until_idle(timeout_s=5) is True
    del group  # freed: its workers are joined
    assert set(gloo_workers.workers()) <= others
