"""Alerts before it is too late: the age of the newest checkpoint, failed saves in a row, restore fallbacks.

A storage that fails every save with ``on_save_error="warn"`` must not let a run
go on unprotected: past ``max_checkpoint_age_*`` the warning becomes an error.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.cli import main as cli
from ckpt_core.cli import parse_age
from ckpt_core.config import CheckpointSettings
from ckpt_core.decisions import checkpoint_too_old, on_stale
from ckpt_core.config import SettingError
from ckpt_core.errors import SaveError, StaleCheckpointError
from ckpt_core.saver import SaveStats
from conftest import WORKERS, run_script
from helpers_ckpt import flip_byte, make_checkpoints, step_path, tiny_model

# ------------------------------------------------------------------ decisions


def test_too_old_by_steps_or_seconds_strictly_past_the_limit():
    assert checkpoint_too_old(5, 0.0, 5, None) is None
    assert "6 steps old, more than max_checkpoint_age_steps=5" == checkpoint_too_old(6, 0.0, 5, None)
    assert checkpoint_too_old(10**6, 10.0**6, None, None) is None
    assert checkpoint_too_old(0, 3601.0, None, 3600.0) == "3601s old, more than max_checkpoint_age_s=3600"
    assert checkpoint_too_old(0, 3600.0, None, 3600.0) is None


def test_only_a_failing_run_under_warn_escalates():
    reason = "9 steps old, more than max_checkpoint_age_steps=5"
    assert on_stale(reason, 1, "warn", "raise") == "raise"
    assert on_stale(reason, 3, "warn", "warn") == "warn"
    assert on_stale(reason, 0, "warn", "raise") is None  # saves commit: protected
    assert on_stale(reason, 2, "raise", "raise") is None  # the failure itself raised
    assert on_stale(None, 5, "warn", "raise") is None


@given(age=st.integers(0, 10_000), limit=st.one_of(st.none(), st.integers(1, 10_000)),
       failed=st.integers(0, 50), policy=st.sampled_from(["raise", "warn"]))
def test_escalation_iff_failing_and_past_the_limit(age, limit, failed, policy):
    action = on_stale(checkpoint_too_old(age, 0.0, limit, None), failed, "warn", policy)
    past = limit is not None and age > limit
    assert action == (policy if past and failed > 0 else None)


def test_settings_validate_and_default_off():
    s = CheckpointSettings()
    assert (s.max_checkpoint_age_s, s.max_checkpoint_age_steps, s.on_stale_checkpoint) == (None, None, "raise")
    for bad in ({"max_checkpoint_age_steps": 0}, {"max_checkpoint_age_s": -1.0}, {"on_stale_checkpoint": "ignore"}):
        with pytest.raises(SettingError):
            CheckpointSettings(**bad)


def test_metrics_of_a_failed_and_a_committed_save():
    failed = SaveStats(step=4, blocking_s=0.0, failed=True, age_s=12.5, failed_saves=2, fallbacks=1)
    assert failed.as_metrics() == {"ckpt/step": 4.0, "ckpt/failed_saves": 2.0, "ckpt/fallbacks": 1.0,
                                   "ckpt/age_s": 12.5}
    ok = SaveStats(step=6, blocking_s=0.1, committed=True, age_s=3.0).as_metrics()
    assert ok["ckpt/failed_saves"] == 0.0 and ok["ckpt/age_s"] == 3.0 and ok["ckpt/bytes"] == 0.0


# ------------------------------------------------------ the always-failing run


def _failing_manager(tmp_path, metrics: list, **kwargs) -> CheckpointManager:
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"fail_after_bytes": 10}))
    kwargs.setdefault("every_n_steps", 2)
    return CheckpointManager(f"faulty://{tmp_path / 'run'}", storage_options={"control": str(control)},
                             async_mode="off", handle_preemption=False, write_retries=0, on_save_error="warn",
                             metrics_callbacks=[metrics.append], env={}, argv=[], **kwargs)


def test_age_escalation_with_a_storage_that_always_fails(tmp_path, caplog):
    """Saves at 2, 4, 6 fail with a warning (6 is 5 steps after the run's first step 1: at the limit); the
    failed save at 8 finds nothing committed for 7 steps and raises, naming age, limit and the setting."""
    metrics: list[SaveStats] = []
    state = TrainState(model=tiny_model(), rng=False)
    m = _failing_manager(tmp_path, metrics, max_checkpoint_age_steps=5)
    reached = 0
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        with pytest.raises(StaleCheckpointError) as info:
            for step in range(1, 20):
                reached = step
                assert m.maybe_save(step, state) is False
                time.sleep(0.002 if step % 2 else 0.0)
    m.close()
    err = info.value
    assert reached == 8 and err.step == 8 and err.last_committed is None
    assert isinstance(err, SaveError) and isinstance(err.__cause__, SaveError)
    assert "7 steps old, more than max_checkpoint_age_steps=5" in str(err)
    assert "on_stale_checkpoint='warn'" in str(err) and "No space left" in str(err)
    assert caplog.text.count("training continues (on_save_error='warn'") == 4
    assert [s.step for s in metrics] == [2, 4, 6, 8] and all(s.failed and not s.committed for s in metrics)
    assert [s.as_metrics()["ckpt/failed_saves"] for s in metrics] == [1.0, 2.0, 3.0, 4.0]
    ages = [s.as_metrics()["ckpt/age_s"] for s in metrics]
    assert ages == sorted(ages) and ages[0] < ages[-1]
    assert m.failed_saves == 4


def test_close_after_failed_saves_ends_the_process_groups_threads(tmp_path):
    """2 ranks, a save that fails on a full storage under ``on_save_error="warn"``, then ``close()`` with the
    garbage collector off: the failed write's reference cycles no longer hold the manager's gloo groups, whose
    threads end in ``close()`` (a group freed during interpreter exit can abort the process)."""
    control = tmp_path / "faults.json"
    control.write_text("{}")
    proc = run_script(WORKERS / "failed_save_worker.py", [str(tmp_path / "run"), str(control), str(tmp_path / "facts")],
                      nproc=2, timeout=120)
    assert proc.stderr.count("training continues (on_save_error='warn'") == 2, proc.stderr[-3000:]
    for rank in range(2):
        facts = json.loads((tmp_path / f"facts.rank{rank}.json").read_text())
        assert facts["failed_saves"] == 1 and facts["after_close"] == facts["before"], facts


def test_stale_warn_policy_goes_on_and_commits_reset_the_count(tmp_path, caplog):
    metrics: list[SaveStats] = []
    state = TrainState(model=tiny_model(), rng=False)
    m = _failing_manager(tmp_path, metrics, max_checkpoint_age_steps=3, on_stale_checkpoint="warn")
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        for step in range(1, 9):
            m.maybe_save(step, state)
    assert "steps old, more than max_checkpoint_age_steps=3" in caplog.text
    assert m.failed_saves == 4
    (tmp_path / "faults.json").write_text("{}")  # the storage recovers
    type(m.fs).clear_instance_cache()
    m.maybe_save(10, state)
    m.close()
    assert metrics[-1].committed and metrics[-1].as_metrics()["ckpt/failed_saves"] == 0.0
    assert m.failed_saves == 0 and m.checkpoint_age_s < 5.0


def test_fallbacks_count_the_checkpoints_skipped_at_the_last_restore(tmp_path):
    root = str(tmp_path / "run")
    make_checkpoints(root, steps=(10, 20))
    flip_byte(step_path(root, 20))
    metrics: list[SaveStats] = []
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizers=opt, schedulers=torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    with CheckpointManager(root, async_mode="off", handle_preemption=False, metrics_callbacks=[metrics.append],
                           env={}, argv=[]) as m:
        with pytest.warns(UserWarning, match="falling back"):
            assert m.restore(state).step == 10
        m.save(30, state)
    assert metrics[-1].committed and metrics[-1].as_metrics()["ckpt/fallbacks"] == 1.0


# ------------------------------------------------------------------------ CLI


def test_parse_age_units():
    assert parse_age("90") == 90 and parse_age("30m") == 1800 and parse_age("1.5h") == 5400
    assert parse_age("2d") == 172800 and parse_age("45s") == 45
    for bad in ("", "h", "-1", "0", "abc", "nan", "3w"):
        with pytest.raises(Exception):
            parse_age(bad)


def test_ls_max_age_exit_codes(tmp_path, capsys):
    root = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    assert cli(["ls", root, "--max-age", "1d"]) == 1  # no valid checkpoint at all
    assert "no valid checkpoint" in capsys.readouterr().err
    make_checkpoints(root, steps=(10,))
    assert cli(["ls", root, "--max-age", "1d"]) == 0
    assert "step 10, 0s old" in capsys.readouterr().out
    time.sleep(0.01)
    assert cli(["ls", root, "--max-age", "0.001s"]) == 1
    assert "(step 10) is 0s old, more than --max-age" in capsys.readouterr().err
    assert cli(["ls", root, "--json", "--max-age", "0.001"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["stale"] is True and body["newest_valid"] == 10 and body["newest_valid_age_s"] > 0
    assert cli(["ls", root]) == 0
    assert cli(["ls", root, "--max-age", "soon"]) == 2


def test_the_age_reaches_the_logger_between_saves_at_the_logging_cadence(tmp_path):
    """Through the loop driver both adapters use: every 3rd step the logger gets the age as of that step, growing
    while saves keep failing (a log line at step 3, 6, 9 even though no save is due then), and the failures in a row."""
    from ckpt_core.loop import LoopDriver

    logged: list[dict] = []
    state = TrainState(model=tiny_model(), rng=False)
    m = _failing_manager(tmp_path, [], every_n_steps=4)
    driver = LoopDriver(m, logged.append, alerts_every_n_steps=3)
    for step in range(1, 10):
        driver.on_step(step, state)
        time.sleep(0.01)
    m.close()
    alerts = [d for d in logged if "ckpt/step" not in d]
    assert [d["ckpt/failed_saves"] for d in alerts] == [0.0, 1.0, 2.0]  # steps 3, 6, 9; saves failed at 4 and 8
    ages = [d["ckpt/age_s"] for d in alerts]
    assert ages == sorted(ages) and ages[0] >= 0.02 and ages[2] - ages[0] >= 0.06  # 10 ms a step
    assert [d["ckpt/step"] for d in logged if "ckpt/step" in d] == [4.0, 8.0]  # the failed saves themselves
