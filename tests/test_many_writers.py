"""Many CheckpointManagers in one process (notebooks, sweeps, test suites): one shared writer, no hang, no mix-up.

torch keeps one checkpoint process per Python process; these tests have several
managers (and Accelerators) save at the same time into it, drop or close some
of them midway, make a save hang and stop the program with signals, and end a
program right after a save. ``ckpt_core.background`` explains the causes.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

import ckpt_core.faults  # noqa: F401  (registers faulty://)
from ckpt_core import CheckpointManager, TrainState, background
from ckpt_core.discovery import list_records
from conftest import REPO, WORKERS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))


def _weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _restored(root: str, step: int, opts: dict | None = None) -> dict:
    model = _model(999)
    with CheckpointManager(root, async_mode="off", handle_preemption=False, storage_options=opts or {}) as m:
        assert m.restore(TrainState(model=model), step=step, set_aside_newer=False).step == step
    return _weights(model)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ issue 1
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["process", "thread", "bytes"])
def test_four_managers_interleaved_saves_dropped_and_closed_midway(tmp_path, mode):
    """4 managers x 3 saves, each save dispatched while the others' are writing; manager 1 is dropped without
    close() with its save in flight, manager 2 is closed, both replaced; none of the others is closed."""
    roots = [str(tmp_path / f"run{i}") for i in range(4)]
    models = [_model(i) for i in range(4)]
    new = lambda i: CheckpointManager(roots[i], async_mode=mode, handle_preemption=False)  # noqa: E731
    managers = [new(i) for i in range(4)]
    expected: dict[tuple[int, int], dict] = {}
    for step in (1, 2, 3):
        for i, model in enumerate(models):
            with torch.no_grad():
                model[0].weight.add_(float(step * 10 + i))
            expected[(i, step)] = _weights(model)
            assert managers[i].save(step, TrainState(model=model)) is True
        if step == 1:
            managers[1] = None  # dropped while its save is writing
            gc.collect()
            managers[1] = new(1)
        if step == 2:
            managers[2].close()
            managers[2] = new(2)
    for m in managers:
        m.wait()
    assert background.wait_pending(60)  # the dropped manager's save too
    for i, root in enumerate(roots):
        assert [(r.step, r.committed) for r in list_records(root)] == [(1, True), (2, True), (3, True)]
        for step in (1, 2, 3):
            assert _same(_restored(root, step), expected[(i, step)]), (i, step)


# ------------------------------------------------------------------ issue 2
@pytest.mark.timeout(120)
def test_keep_last_2_saves_in_a_row_with_wait_commit_and_retain(tmp_path):
    """keep_last=2, process mode, save() then wait() round after round, three managers writing at once (more
    Accelerators, a sweep's next run): before, replies of the shared process were torn between the waiting
    threads ("invalid load key", "background process is dead") or one thread waited forever for a reply that
    another had read, while the process waited for the next request."""
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"delay_per_file_s": 0.05}))  # a save takes long enough to overlap the others
    opts = {"control": str(control)}
    roots = [f"faulty://{tmp_path / name}" for name in ("a", "b", "c")]
    models = [_model(i) for i in range(len(roots))]
    managers = [CheckpointManager(r, async_mode="process", keep_last=2, handle_preemption=False,
                                  storage_options=opts) for r in roots]
    expected = {}
    for step in (1, 2, 3, 4, 5):
        for i, (m, model) in enumerate(zip(managers, models)):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            expected[(i, step)] = _weights(model)
            assert m.save(step, TrainState(model=model)) is True
        for m in managers:
            m.wait()
    for i, (m, root) in enumerate(zip(managers, roots)):
        assert [(s.step, s.committed, s.deleted) for s in m.save_history] == [
            (1, True, []), (2, True, []), (3, True, [1]), (4, True, [2]), (5, True, [3])]
        assert [(r.step, r.committed) for r in list_records(root, opts)] == [(4, True), (5, True)]
        assert _same(_restored(root, 5, opts), expected[(i, 5)])
        assert _same(_restored(root, 4, opts), expected[(i, 4)])


# ------------------------------------------------------------------ issue 3
def _launch(tmp_path: Path, name: str, scenario: str, mode: str) -> subprocess.Popen:
    root = tmp_path / name
    root.mkdir()
    cmd = [sys.executable, str(WORKERS / "many_writers_worker.py"), "--root", str(root),
           "--control", str(root / "control.json"), "--scenario", scenario, "--mode", mode]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # A child inherits an ignored SIGINT, and Python then keeps ignoring Ctrl-C: whatever an earlier test of this
    # pytest process left installed, the worker starts with the default disposition, as from a shell.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _exit_code(proc: subprocess.Popen, timeout: float) -> object:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "hung"


SCENARIOS = {  # name: (scenario, mode, signals, rc)
    "wait-process-2xSIGTERM": ("wait", "process", [signal.SIGTERM, signal.SIGTERM], -signal.SIGTERM),
    "preempt-2xSIGTERM": ("preempt", "thread", [signal.SIGTERM, signal.SIGTERM], -signal.SIGTERM),
    "close-ctrl-c": ("close", "thread", [signal.SIGINT], -signal.SIGINT),  # close() waits through wait()
    "atexit-ctrl-c": ("atexit", "thread", [signal.SIGINT], 0),
}


@pytest.mark.timeout(120)
def test_a_hung_save_is_ended_by_a_second_sigterm_or_ctrl_c(tmp_path):
    """A save whose storage hangs, waited for by wait(), close(), the exit flush or a preemption save, with a
    manager dropped without close() before: the first SIGTERM means "save and exit" (the process keeps waiting),
    a second one ends it at once; so does one Ctrl-C. The scenarios run side by side, one process each."""
    procs = {name: _launch(tmp_path, name, scenario, mode) for name, (scenario, mode, _, _) in SCENARIOS.items()}
    for proc in procs.values():
        assert proc.stdout.readline().strip() == "waiting"
    time.sleep(1.5)  # well inside the wait for the hung save (or the exit flush)
    for name, proc in procs.items():
        if len(SCENARIOS[name][2]) == 2:
            proc.send_signal(SCENARIOS[name][2][0])
    time.sleep(1.0)
    alive = {name: proc.poll() is None for name, proc in procs.items()}
    children = {name: psutil.Process(p.pid).children(recursive=True) if alive[name] else []
                for name, p in procs.items()}
    t0 = time.monotonic()
    for name, proc in procs.items():
        proc.send_signal(SCENARIOS[name][2][-1])
    codes = {name: _exit_code(proc, max(1.0, t0 + 20 - time.monotonic())) for name, proc in procs.items()}
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5  # a writer process notices within 0.5 s that its parent is gone
    while any(_running(c) for cs in children.values() for c in cs) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = {name: [c.pid for c in cs if _running(c)] for name, cs in children.items()}
    for c in (c for cs in children.values() for c in cs):  # never leave a writer behind, whatever the outcome
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    stderr = {name: proc.stderr.read() for name, proc in procs.items()}
    got = {n: (alive[n], codes[n], orphans[n]) for n in SCENARIOS}
    assert got == {n: (True, rc, []) for n, (*_, rc) in SCENARIOS.items()}, \
        {n: stderr[n][-3000:] for n, (*_, rc) in SCENARIOS.items() if got[n][1] != rc}
    assert took < 15  # before: each of them hung (SIGTERM swallowed, or an unbounded wait at exit)
    assert "preemption signal 15 received; saving step" in stderr["preempt-2xSIGTERM"]
    assert "interrupted at exit; saves still writing stay uncommitted" in stderr["atexit-ctrl-c"]
    assert not list(tmp_path.glob("*/run/step_*/manifest.json"))  # nothing half-written was committed


# ------------------------------------------------------------------ issue 4
@pytest.mark.timeout(120)
def test_normal_exit_right_after_a_save_commits_quietly(tmp_path):
    """No close(), no wait(): the exit flush commits the save in flight (and one of a manager dropped earlier),
    runs retention (keep_last=1) and prints nothing."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKERS / "many_writers_worker.py"), "--root", str(tmp_path),
                           "--scenario", "exit", "--mode", "process"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=110)
    assert proc.returncode == 0 and proc.stdout == "returned\n", proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if "ckpt_core" in line or "future" in line]
    assert ours == []
    assert [(r.step, r.committed) for r in list_records(str(tmp_path / "run"))] == [(2, True)]
    assert [(r.step, r.committed) for r in list_records(str(tmp_path / "dropped"))] == [(7, True)]
    assert (tmp_path / "run" / "step_000000002" / "manifest.json").exists()
    assert _same(_restored(str(tmp_path / "run"), 2), torch.load(tmp_path / "expected.pt", weights_only=True))


# ------------------------------------------------------------------ Accelerate
def _train_step(acc, model, opt) -> None:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt) -> dict:
    out = {f"model.{k}": v for k, v in _weights(model).items()}
    for pid, st in opt.state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


@pytest.mark.timeout(120)
def test_four_accelerators_three_saves_each_interleaved_none_closed(tmp_path):
    """4 Accelerators in one process (Accelerate's tests, a sweep, a notebook), a CheckpointPlugin in process mode
    attached to each before prepare, 3 saves each through plugin.save() interleaved, none closed; then every root
    restores each step exactly into a fresh Accelerator."""
    pytest.importorskip("accelerate")
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_ckpt import CheckpointPlugin

    def prepared(root: str, **kw):
        acc = accelerate.Accelerator(cpu=True)
        plugin = CheckpointPlugin(dirpath=root, env={}, argv=[], **kw).attach(acc)
        model = _model(0)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        return acc, plugin, model, opt

    roots = [str(tmp_path / f"acc{i}") for i in range(4)]
    try:
        runs = [prepared(root, async_mode="process") for root in roots]
        expected = {}
        for step in (1, 2, 3):
            for i, (acc, plugin, model, opt) in enumerate(runs):
                _train_step(acc, model, opt)
                expected[(i, step)] = _snapshot(model, opt)
                assert plugin.save(step=step) == f"{roots[i]}/step_{step:09d}"
        for _, plugin, _, _ in runs:
            plugin.wait()  # not close()
        for i, root in enumerate(roots):
            assert [(r.step, r.committed) for r in list_records(root)] == [(1, True), (2, True), (3, True)]
            for step in (3, 2, 1):  # newest first: restoring an older step is a rollback (moves newer ones aside)
                AcceleratorState._reset_state(True)
                GradientState._reset_state()
                _, plugin, model, opt = prepared(root, async_mode="off", handle_preemption=False)
                assert plugin.restore(step=step).step == step
                assert _same(_snapshot(model, opt), expected[(i, step)]), (i, step)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
