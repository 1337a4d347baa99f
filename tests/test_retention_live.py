"""Retention against real storage: concurrent with async saves, and crash-safe deletion."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import torch
from torch import nn

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.discovery import list_records, read_manifest, validate
from ckpt_core.storage import get_fs
from conftest import REPO, WORKERS, run_script


def test_retention_deletes_concurrently_with_async_saves(tmp_path):
    out = tmp_path / "out.json"
    run_script(WORKERS / "retention_worker.py", ["--root", str(tmp_path / "ckpt"), "--out", str(out)], nproc=2)
    got = json.loads(out.read_text())
    assert got["problems"] == []
    assert got["samples"] >= 20
    # keep_last=2 plus the permanent tier every 10 steps, from saves at 2, 4, ..., 30
    assert {int(k): v for k, v in got["final"].items()} == {10: True, 20: True, 28: True, 30: True}
    assert got["restored"] == 30 and got["same_params"]
    assert got["groups_left"] == [0, 0]  # each manager's close() destroyed its process groups (gloo threads joined)


def test_retention_counts_checkpoints_written_before_a_restart(tmp_path):
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    state = TrainState(model=model)
    with CheckpointManager(root, async_mode="off", keep_last=3, handle_preemption=False) as m:
        for step in (1, 2, 3):
            m.save(step, state)
    with CheckpointManager(root, async_mode="off", keep_last=3, handle_preemption=False) as m:
        assert m.restore(state).step == 3
        for step in (4, 5):
            m.save(step, state)
    assert [r.step for r in list_records(root)] == [3, 4, 5]


def test_rollback_protects_the_resumed_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    model = nn.Linear(4, 4)
    state = TrainState(model=model)
    with CheckpointManager(root, async_mode="off", keep_last=2, handle_preemption=False) as m:
        for step in (1, 2, 3):
            m.save(step, state)
    with CheckpointManager(root, async_mode="off", keep_last=2, handle_preemption=False) as m:
        assert m.restore(state, step=2).step == 2  # rollback: 3 is moved aside
        for step in (3, 4, 5):
            m.save(step, state)
    # 2 is the checkpoint this run resumed from: kept although keep_last=2 would drop it
    assert [r.step for r in list_records(root)] == [2, 4, 5]
    aside = list((tmp_path / "ckpt" / "rolled_back").iterdir())
    assert len(aside) == 1 and (aside[0] / "step_000000003" / "manifest.json").exists()


def test_sigkill_during_deletion_leaves_no_committed_checkpoint_with_missing_files(tmp_path):
    root = tmp_path / "ckpt"
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    state = TrainState(model=model, optimizers=torch.optim.Adam(model.parameters()))
    model(torch.randn(2, 8)).sum().backward()
    state.optimizers[0].step()
    with CheckpointManager(str(root), async_mode="off", writer_threads=4, handle_preemption=False) as m:
        for step in (1, 2, 3, 4):
            m.save(step, state)
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"delay_per_rm_s": 0.3}))
    proc = subprocess.Popen([sys.executable, str(WORKERS / "delete_worker.py"), f"faulty://{root}", str(control),
                             "1,2,3"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "deleting"
    time.sleep(2.0)  # several files into the deletion
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    recs = list_records(str(root))
    partially = [r for r in recs if not r.committed]
    assert partially, "the kill should have landed in the middle of a deletion"
    assert any(list((root / f"step_{r.step:09d}").iterdir()) for r in partially)  # files left behind
    for r in recs:
        if r.committed:
            assert validate(r.path, read_manifest(get_fs(r.path)[0], r.path), "size") is None
    assert recs[-1].step == 4 and recs[-1].committed
