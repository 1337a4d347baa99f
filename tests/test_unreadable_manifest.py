"""A manifest.json that exists but cannot be read (an I/O error) leaves its checkpoint's state unknown.

Retention never takes such a directory for crash garbage and deletes it; restore
passes it over with a warning and counts it as a fallback, never silently.
"""

from __future__ import annotations

import json

import torch

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.discovery import list_records
from ckpt_core.storage import step_dirname
from helpers_ckpt import restore_warned, tiny_model


def _manager(root: str, control, **kwargs) -> CheckpointManager:
    kwargs.setdefault("keep_last", 1)
    return CheckpointManager(root, storage_options={"control": str(control)}, every_n_steps=1,
                             async_mode="off", handle_preemption=False, env={}, argv=[], **kwargs)


def _fail_reads(control, step: int | None) -> None:
    cfg = {} if step is None else {"fail_reads_matching": f"{step_dirname(step)}/manifest.json"}
    control.write_text(json.dumps(cfg))


def test_retention_never_deletes_a_checkpoint_whose_manifest_cannot_be_read(tmp_path):
    root, control = f"faulty://{tmp_path / 'run'}", tmp_path / "faults.json"
    _fail_reads(control, None)
    model = tiny_model()
    state = TrainState(model=model, rng=False)
    with _manager(root, control) as m:
        m.save(1, state)
        _fail_reads(control, 1)  # from here on, step 1's manifest answers EIO
        for step in (2, 3):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            m.save(step, state)
    records = {r.label: r for r in list_records(root, {"control": str(control)})}
    assert sorted(records) == [1, 3]  # keep_last=1 deleted committed step 2, never the unknown step 1
    assert records[1].unreadable and not records[1].committed
    assert "manifest.json cannot be read" in records[1].problem
    assert (tmp_path / "run" / step_dirname(1) / "manifest.json").is_file()
    _fail_reads(control, None)
    assert [r.step for r in list_records(root, {"control": str(control)}) if r.committed] == [1, 3]


def test_restore_warns_when_it_passes_over_an_unreadable_manifest(tmp_path):
    root, control = f"faulty://{tmp_path / 'run'}", tmp_path / "faults.json"
    _fail_reads(control, None)
    model = tiny_model()
    with _manager(root, control, keep_last=None) as m:
        for step in (1, 2):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            m.save(step, TrainState(model=model, rng=False))
    _fail_reads(control, 2)
    fresh = tiny_model()
    info, said = restore_warned(root, TrainState(model=fresh, rng=False), storage_options={"control": str(control)})
    assert info.step == 1
    assert f"{step_dirname(2)} (step 2) is skipped: manifest.json cannot be read: OSError" in said, said
