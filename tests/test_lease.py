"""One root, one job: the lease on a checkpoint root (``ckpt_core.lease``, ``lease_holder``, the manager, the CLI)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import REPO, WORKERS
from ckpt_core import CheckpointManager, LeaseHeldError, LeaseLostError, TrainState
from ckpt_core import lease as L
from helpers_ckpt import run_cli, tiny_model

NOW = 1_800_000_000.0


def _rec(**kw) -> L.LeaseRecord:
    base = dict(run_id="torchelastic:job-a", holder="a" * 32, host="node-7", machine="node-7|boot|pid:[1]", pid=4242,
                pid_start=99, started=NOW - 600, refreshed=NOW - 10, ttl_s=120.0, generation=3)
    return L.LeaseRecord(**{**base, **kw})


CLAIM = L.Claim("torchelastic:job-b", "b" * 32)


# ------------------------------------------------------------------ pure decision
@pytest.mark.parametrize("current, alive, action, warn, said", [
    (None, None, L.TAKE, False, "no lease"),
    (_rec(holder="b" * 32), None, L.REENTER, False, "this process"),
    (_rec(released=True), None, L.TAKE, False, "released"),
    (_rec(run_id="torchelastic:job-b"), True, L.TAKE, False, "restart of the same run"),
    (_rec(), False, L.TAKE, True, "process is gone"),
    (_rec(refreshed=NOW - 121), None, L.TAKE, True, "expired"),
    (_rec(refreshed=NOW - 119), None, L.REFUSE, False, "refreshed 119s ago"),
    (_rec(), True, L.REFUSE, False, "pid 4242 on node-7"),
])
def test_who_may_take_the_lease(current, alive, action, warn, said):
    got, reason, warned = L.decide(current, CLAIM, NOW, alive)
    assert (got, warned) == (action, warn) and said in reason


def test_the_run_id_comes_from_the_setting_then_the_launchers():
    env = {"TORCHELASTIC_RUN_ID": "rdzv-1", "SLURM_JOB_ID": "77"}
    assert L.job_run_id("mine", env) == ("mine", "the run_id setting")
    assert L.job_run_id(None, env)[0] == "torchelastic:rdzv-1"
    assert L.job_run_id(None, {"SLURM_JOB_ID": "77"})[0] == "slurm:77"
    agent = L.job_run_id(None, {"TORCHELASTIC_RUN_ID": "none"})  # torchrun without --rdzv-id: the agent
    assert agent[0].endswith(f":{os.getppid()}") and agent[0].startswith("torchrun:")
    alone = L.job_run_id(None, {})
    assert alone[0].startswith("process:") and f":{os.getpid()}:" in alone[0]


@given(st.binary(max_size=300))
def test_a_lease_file_parses_or_is_refused_clearly(data):
    try:
        rec = L.parse(data, 1)
    except L.LeaseFormatError as e:
        assert "lease generation 1" in str(e)
    else:
        assert isinstance(rec, L.LeaseRecord)


def test_a_rendered_lease_parses_back():
    rec = _rec()
    assert L.parse(L.render(rec), rec.generation) == rec


def test_this_process_is_alive_and_a_dead_one_is_not():
    me = _rec(machine=L.this_machine(), pid=os.getpid(), pid_start=L.process_start(os.getpid()))
    assert L.holder_alive(me) is True
    assert L.holder_alive(replace(me, pid_start=me.pid_start + 1)) is False  # the PID was reused
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert L.holder_alive(replace(me, pid=dead.pid, pid_start=0)) is False
    assert L.holder_alive(replace(me, machine="elsewhere|boot|pid:[1]")) is None  # another machine: unknown


# ------------------------------------------------------------------ storage
@pytest.mark.parametrize("url", ["local", "memory"])
def test_two_jobs_racing_for_one_generation_one_wins(tmp_path, url):
    fs = fsspec.filesystem("file" if url == "local" else "memory")
    files = L.LeaseFiles(fs, str(tmp_path / "root") if url == "local" else f"/lease-race-{os.getpid()}")
    won: dict[int, bool] = {}
    barrier = threading.Barrier(8)

    def take(i: int) -> None:
        barrier.wait()
        won[i] = files.create(_rec(holder=f"{i:032d}", generation=1))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    current, top, problem = files.current()
    winners = [i for i, ok in won.items() if ok]
    assert len(won) == 8 and len(winners) == 1 and top == 1 and problem is None
    assert current is not None and current.holder == f"{winners[0]:032d}"  # the file is the winner's, whole


def _forge(root: Path, rec: L.LeaseRecord) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / L.generation_name(rec.generation)).write_bytes(L.render(rec))


def _lease_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(L.LEASE_PREFIX))


def _manager(root: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(root), async_mode="off", every_n_steps=1, handle_preemption=False, env={}, argv=[],
                             **kw)


# ------------------------------------------------------------------ in one process
def test_a_live_lease_of_another_machine_refuses_the_job_naming_the_holder(tmp_path):
    root = tmp_path / "run"
    _forge(root, _rec(refreshed=time.time() - 5))
    with pytest.raises(LeaseHeldError, match=r"in use by another job: run 'torchelastic:job-a' \(pid 4242 on node-7"):
        _manager(root)
    assert not any(p.name.startswith("step_") for p in root.iterdir())


def test_an_expired_lease_is_taken_over_with_a_warning(tmp_path, caplog):
    root = tmp_path / "run"
    _forge(root, _rec(refreshed=time.time() - 30, ttl_s=20.0))
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        m = _manager(root, run_id="job-b")
    assert "taking over the expired lease of run 'torchelastic:job-a'" in caplog.text
    current, top, _ = L.LeaseFiles(fsspec.filesystem("file"), str(root)).current()
    assert (top, current.run_id, current.pid) == (4, "job-b", os.getpid())
    assert _lease_files(root) == [".ckpt-lease.000000000004.json"]  # a file beside the checkpoints, the old one gone
    m.close()
    assert _lease_files(root) == []  # a clean end leaves nothing: the next job takes the root at once


def test_the_same_run_id_is_a_restart_and_several_managers_of_a_process_share_the_lease(tmp_path, caplog):
    root = tmp_path / "run"
    _forge(root, _rec(run_id="job-a", refreshed=time.time()))
    with caplog.at_level(logging.INFO, logger="ckpt_core"):
        a = _manager(root, run_id="job-a")
    assert "a restart of the same run" in caplog.text
    b = _manager(root, run_id="another-id")  # re-entrant in the process: two Accelerators on one directory
    state = TrainState(model=tiny_model(), rng=False)
    assert a.save(1, state) and b.save(2, state)
    a.close()
    assert _lease_files(root) == [L.generation_name(4)]  # b still uses it
    b.close()
    assert _lease_files(root) == []


def test_a_job_whose_lease_was_taken_over_stops_saving_and_deleting(tmp_path, caplog):
    root = tmp_path / "run"
    m = CheckpointManager(str(root), async_mode="off", keep_last=1, handle_preemption=False, env={}, argv=[])
    state = TrainState(model=tiny_model(), rng=False)
    assert m.save(1, state) and m._lease is not None
    gen = m._lease.record.generation
    _forge(root, _rec(refreshed=time.time(), generation=gen + 1))  # another job took over (this one looked dead)
    m._lease.refresh()  # what the refresh thread does every lease_ttl_s / 4
    with pytest.raises(LeaseLostError, match="lost the lease on checkpoint root .* run 'torchelastic:job-a'"):
        m.save(2, state)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_000000001"]
    m.close()


def test_a_storage_failure_while_taking_the_lease_follows_on_save_error(tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"fail_after_bytes": 0}))
    opts = {"storage_options": {"control": str(control)}, "handle_preemption": False, "env": {}, "argv": []}
    with pytest.raises(L.LeaseError, match="could not take the lease .* No space left"):
        CheckpointManager(f"faulty://{tmp_path / 'a'}", every_n_steps=1, **opts)
    m = CheckpointManager(f"faulty://{tmp_path / 'b'}", every_n_steps=1, on_save_error="warn", **opts)
    assert m.save(1, TrainState(model=tiny_model(), rng=False)) is False and m.failed_saves == 1
    m.close()


def test_ckpt_ls_names_the_holder_and_prune_spares_uncommitted_directories_under_a_live_lease(tmp_path, capsys):
    root = tmp_path / "run"
    m = _manager(root, keep_last=5)
    state = TrainState(model=tiny_model(), rng=False)
    for step in (1, 2, 3):
        m.save(step, state)
    m.wait()  # retention of the job itself has run
    (root / "step_000000002" / "manifest.json").unlink()  # as a save still writing would look
    code, out, _ = run_cli(capsys, "ls", str(root))
    assert code == 0 and "lease: live, run 'process:" in out and f"pid {os.getpid()}" in out
    code, out, _ = run_cli(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 0 and "deleting step 1 " in out and "deleting step 2 " not in out
    assert (root / "step_000000002").exists() and not (root / "step_000000001").exists()
    assert "a live job holds the lease" in out
    m.close()
    code, out, _ = run_cli(capsys, "ls", str(root))
    assert "lease: none" in out


# ------------------------------------------------------------------ real processes
def _job(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    full.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.Popen([sys.executable, str(WORKERS / "lease_worker.py"), "--root", str(root), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def _wait_for(proc: subprocess.Popen, prefix: str) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read()[-2000:]}")


def test_a_second_job_is_refused_then_takes_over_after_a_kill_and_a_restart_is_never_refused(tmp_path):
    """Job A saves every step (keep_last 2); job B on the same root is refused and deletes nothing; after A's
    SIGKILL, job C takes over (A's process is gone) and resumes A's newest checkpoint; a restart of C under the
    same torchrun run id, while C still runs, is not refused."""
    root = tmp_path / "run"
    a = _job(root, env={"TORCHELASTIC_RUN_ID": "job-a"})
    try:
        _wait_for(a, "saved 3")
        b = _job(root, "--steps", "3")
        out, err = b.communicate(timeout=120)
        assert b.returncode == 7, err[-2000:]
        assert f"run 'torchelastic:job-a' (pid {a.pid} on " in out and "Give this job its own dirpath" in out
        _wait_for(a, "saved 8")  # A went on saving, with nothing of it deleted by B
    finally:
        a.kill()
        a.wait()
    c = _job(root, env={"TORCHELASTIC_RUN_ID": "job-c"})
    try:
        resumed = int(_wait_for(c, "resumed").split()[1])
        assert resumed >= 8
        saved = int(_wait_for(c, "saved").split()[1])
    finally:
        c.kill()
        c.wait()
    said = c.stderr.read()
    assert "taking over the lease of run 'torchelastic:job-a'" in said and "that process is gone" in said, said[-2000:]
    restart = _job(root, "--steps", "2", env={"TORCHELASTIC_RUN_ID": "job-c"})  # torchrun restarting C's workers
    out, err = restart.communicate(timeout=120)
    # one save at most was still writing at the kill (each save waits for the one before)
    assert restart.returncode == 0 and int(out.split()[1]) >= saved - 1 and "saved" in out, err[-2000:]
    assert "taking over" not in err  # a restart of the same job: no warning either
    assert _lease_files(root) == []  # it ended cleanly


def test_a_dropped_managers_lease_released_by_a_garbage_collection_inside_hold_never_deadlocks(tmp_path,
                                                                                              monkeypatch):
    """A manager dropped without ``close()`` inside a reference cycle is finalized by whichever allocation
    triggers the garbage collector next; inside ``lease_holder.hold`` (which holds its lock) that finalizer
    used to wait for the lock forever. Its lease is released once the lock is free instead."""
    import gc

    from ckpt_core import lease_holder

    dropped = _manager(tmp_path / "a")
    dropped.cycle = dropped  # only the garbage collector frees it
    assert _lease_files(tmp_path / "a") == [".ckpt-lease.000000000001.json"]
    del dropped
    real_init = lease_holder.RootLease.__init__

    def collecting_init(self, *args, **kwargs):  # the collection runs while hold() holds the lock
        gc.collect()
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(lease_holder.RootLease, "__init__", collecting_init)
    made = []
    worker = threading.Thread(target=lambda: made.append(_manager(tmp_path / "b")), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "deadlock: the finalizer waited for the lock its own thread held"
    assert _lease_files(tmp_path / "a") == []  # released as soon as hold() let go of the lock
    assert _lease_files(tmp_path / "b") == [".ckpt-lease.000000000001.json"]
    made[0].close()
    assert _lease_files(tmp_path / "b") == []
