"""One settings rule for every entry point: defaults < settings < code < ``CKPT_*`` env < ``--ckpt.*`` flags.

The core ``CheckpointManager``, the Lightning callback and the Accelerate plugin
read the process environment and command line the same way, and a misspelt
``CKPT_`` variable is an error naming the closest setting, at construction.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ckpt_core import CheckpointManager, CheckpointSettings, TrainState, list_records
from ckpt_core.config import SettingError, UnknownSettingError


@pytest.fixture
def environ(monkeypatch):
    for var in [v for v in os.environ if v.startswith("CKPT_")]:
        monkeypatch.delenv(var)
    return monkeypatch


def test_core_manager_reads_environment_and_flags(tmp_path, environ):
    environ.setenv("CKPT_KEEP_LAST", "1")
    environ.setattr(sys, "argv", ["train.py", "--lr", "0.1", "--ckpt.every_n_steps=2"])
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(str(tmp_path), keep_last=5, async_mode="off") as manager:
        assert (manager.settings.keep_last, manager.settings.every_n_steps) == (1, 2)
        assert manager.sources["keep_last"] == "env CKPT_KEEP_LAST"
        assert manager.sources["every_n_steps"] == "flag --ckpt.every_n_steps"
        state = TrainState(model=model)
        for step in range(1, 7):
            manager.maybe_save(step, state)
    assert [r.step for r in list_records(str(tmp_path)) if r.committed] == [6]  # saves at 2, 4, 6; keep 1
    with CheckpointManager(str(tmp_path), async_mode="off", env={}, argv=[]) as plain:  # resolved elsewhere
        assert plain.settings.keep_last is None and plain.sources["keep_last"] == "default"


def test_core_manager_misspelt_variable_is_an_error(tmp_path, environ):
    environ.setenv("CKPT_EVRY_N_STEPS", "2")
    with pytest.raises(UnknownSettingError, match="did you mean CKPT_EVERY_N_STEPS"):
        CheckpointManager(str(tmp_path), async_mode="off")
    environ.delenv("CKPT_EVRY_N_STEPS")
    environ.setenv("CKPT_KEEP_LAST", "0")
    with pytest.raises(SettingError) as info:
        CheckpointManager(str(tmp_path), async_mode="off")
    assert (info.value.name, info.value.source, info.value.raw) == ("keep_last", "env CKPT_KEEP_LAST", "0")
    assert "environment variable CKPT_KEEP_LAST='0'" in str(info.value)


def test_lightning_callback_reads_environment_and_flags(tmp_path, environ, caplog):
    pytest.importorskip("lightning")
    import lightning.pytorch as L

    from lightning_ckpt import DistributedCheckpoint

    sys.path.insert(0, str(os.path.join(os.path.dirname(__file__), "..", "examples")))
    import lightning_train

    environ.setenv("CKPT_EVERY_N_STEPS", "2")
    environ.setenv("CKPT_KEEP_LAST", "1")
    environ.setattr(sys, "argv", ["cli.py", "fit", "--ckpt.verify=checksum"])
    started: list = []
    real_init = torch.distributed.init_process_group
    environ.setattr(torch.distributed, "init_process_group", lambda *a, **k: started.append(a) or real_init(*a, **k))
    cb = DistributedCheckpoint(dirpath=tmp_path / "ck", settings=CheckpointSettings(writer_threads=2))
    assert (cb.settings.every_n_steps, cb.settings.keep_last, cb.settings.verify) == (2, 1, "checksum")
    assert cb.settings.writer_threads == 2 and cb.sources["verify"] == "flag --ckpt.verify"
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp_path),
                        callbacks=[cb])
    import logging

    shown = logging.getLogger("lightning.pytorch.ckpt")
    assert shown.getEffectiveLevel() <= logging.INFO  # Lightning's default level shows the start-up line
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(lightning_train.Regressor())
    assert "effective checkpoint settings" in caplog.text and "[env CKPT_KEEP_LAST]" in caplog.text
    assert [r.step for r in list_records(str(tmp_path / "ck")) if r.committed] == [6]
    assert cb.settings.async_mode == "bytes"  # the default, on one device too
    assert started == []  # it needs no process group: a one-device run stays undistributed

    environ.setenv("CKPT_EVRY_N_STEPS", "2")
    with pytest.raises(UnknownSettingError, match="CKPT_EVRY_N_STEPS.*did you mean CKPT_EVERY_N_STEPS"):
        DistributedCheckpoint(dirpath=tmp_path / "ck")


def test_lightning_settings_are_not_overridden_by_arguments_left_out(tmp_path, environ):
    pytest.importorskip("lightning")
    from lightning_ckpt import DistributedCheckpoint

    environ.setattr(sys, "argv", ["train.py"])
    given = CheckpointSettings(keep_last=1, verify="checksum", every_n_steps=7, resume=False)
    cb = DistributedCheckpoint(dirpath=tmp_path, settings=given)
    assert (cb.settings.keep_last, cb.settings.verify, cb.settings.every_n_steps, cb.settings.resume) == (
        1, "checksum", 7, False)
    cb = DistributedCheckpoint(dirpath=tmp_path, settings=given, keep_last=3)
    assert cb.settings.keep_last == 3 and cb.sources["keep_last"] == "code"


def test_accelerate_plugin_reads_the_process_environment_and_command_line(tmp_path, environ):
    pytest.importorskip("accelerate")
    from accelerate_ckpt import CheckpointPlugin

    environ.setenv("CKPT_EVERY_N_STEPS", "7")
    environ.setattr(sys, "argv", ["train.py", "--ckpt.keep_last=2", "--lr", "1"])
    plugin = CheckpointPlugin(dirpath=str(tmp_path), every_n_steps=100, keep_last=5)
    assert (plugin.settings.every_n_steps, plugin.settings.keep_last) == (7, 2)
    environ.setenv("CKPT_EVRY_N_STEPS", "7")
    with pytest.raises(UnknownSettingError, match="did you mean CKPT_EVERY_N_STEPS"):
        CheckpointPlugin(dirpath=str(tmp_path))
