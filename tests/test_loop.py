"""The loop driver both adapters use: roots, checkpoint paths, metrics handed to the training thread, restores."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ckpt_core import CheckpointManager, TrainState, list_records
from ckpt_core.loop import LoopDriver, checkpoint_target, same_root, split_checkpoint_path


def test_same_root_and_checkpoint_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert same_root("ck", str(tmp_path / "ck")) and same_root("ck/", "./ck")
    assert not same_root("ck", "other") and not same_root("memory://ck", str(tmp_path / "ck"))
    assert same_root("memory://a/b/", "memory://a/b")
    assert split_checkpoint_path("s3://b/run/step_000000012/") == ("s3://b/run", 12)
    assert split_checkpoint_path("s3://b/run") == ("s3://b/run", None)
    assert split_checkpoint_path("step_7") == (".", 7)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def test_restore_from_a_path_a_root_and_another_root(tmp_path):
    a = _model(0)
    saved = {}
    with CheckpointManager(str(tmp_path / "a"), async_mode="off", env={}, argv=[]) as m:
        for step in (2, 4):
            a.weight.data += 1
            saved[step] = a.weight.detach().clone()
            m.save(step, TrainState(model=a))
    os.rename(tmp_path / "a" / "step_000000004", tmp_path / "named_by_user")
    assert checkpoint_target(str(tmp_path / "named_by_user")) == {"path": str(tmp_path / "named_by_user")}
    assert checkpoint_target(str(tmp_path / "a")) == {"root": str(tmp_path / "a")}

    b = _model(1)
    with CheckpointManager(str(tmp_path / "b"), async_mode="off", env={}, argv=[]) as m:
        driver = LoopDriver(m)
        rec = driver.restore(TrainState(model=b), **checkpoint_target(str(tmp_path / "named_by_user")))
        assert rec.step == 4 and torch.equal(b.weight, saved[4])
        rec = driver.restore(TrainState(model=b), root=str(tmp_path / "a"))  # another root: its newest valid
        assert rec.step == 2 and torch.equal(b.weight, saved[2])
        assert driver.restore(TrainState(model=b)) is None  # its own root is empty
    assert [r.step for r in list_records(str(tmp_path / "a"))] == [2]  # nothing moved or deleted there


def test_metrics_reach_the_sink_on_the_training_thread_only(tmp_path):
    got = []
    model = _model(0)
    with CheckpointManager(str(tmp_path), every_n_steps=2, async_mode="thread", env={}, argv=[]) as m:
        driver = LoopDriver(m, lambda metrics: got.append((threading.current_thread().name, metrics["ckpt/step"])))
        state = TrainState(model=model)
        for step in range(1, 5):
            driver.on_step(step, state, loss=torch.tensor(0.5))
        driver.finish()
    assert got == [("MainThread", 2.0), ("MainThread", 4.0)]


def test_manager_and_driver_are_freed_without_the_cyclic_collector(tmp_path):
    """No reference cycle through the stage objects: a manager dropped by the script is freed at once, with its
    process groups, not by the cyclic collector at interpreter exit (a gloo group destroyed then aborts)."""
    import gc
    import weakref

    gc.disable()
    try:
        manager = CheckpointManager(str(tmp_path), every_n_steps=1, async_mode="thread", env={}, argv=[])
        driver = LoopDriver(manager, lambda metrics: None)
        driver.on_step(1, TrainState(model=_model(0)))
        driver.finish()
        manager.close()
        refs = weakref.ref(manager), weakref.ref(driver)
        del manager, driver
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_load_model_weights_checks_the_model_only_and_keeps_full_restores_strict(tmp_path):
    from ckpt_core import CheckpointSettings, RestoreError
    from ckpt_core.loop import load_model_weights

    model = _model(0)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with CheckpointManager(str(tmp_path), async_mode="off", env={}, argv=[]) as m:
        m.save(3, TrainState(model=model, optimizers=opt, schedulers=sched))
    fresh = _model(1)
    rng = torch.get_rng_state()
    rec = load_model_weights(fresh, str(tmp_path), CheckpointSettings())
    assert rec.step == 3 and torch.equal(fresh.weight, model.weight) and torch.equal(rng, torch.get_rng_state())
    # a training restore that would silently drop the optimizer state still refuses the checkpoint
    with CheckpointManager(str(tmp_path), async_mode="off", env={}, argv=[]) as m:
        with pytest.raises(RestoreError, match="could be restored"):
            m.restore(TrainState(model=_model(2)))
