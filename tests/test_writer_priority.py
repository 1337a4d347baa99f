"""The background writer process yields the CPU to training (``writer_nice``); the trainer never changes priority."""

from __future__ import annotations

import os

import psutil
import pytest

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.config import SettingError
from ckpt_core.dcp_io import renice_threads
from helpers_ckpt import tiny_model


BASE = os.getpriority(os.PRIO_PROCESS, 0)
"""The nice value the suite runs at (0 unless it was started under ``nice``)."""


def _nice_of_threads(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}


def _save(tmp_path, mode: str, **kwargs) -> CheckpointManager:
    m = CheckpointManager(str(tmp_path / mode), async_mode=mode, handle_preemption=False, lease=False, env={},
                          argv=[], **kwargs)
    m.save(1, TrainState(model=tiny_model(), rng=False))
    m.wait()
    return m


def test_process_mode_writer_runs_at_writer_nice_and_the_trainer_is_untouched(tmp_path):
    """The writer process is shared by every manager of the process (and never made less nice): 19 is the
    highest value, whatever saves ran before in this process."""
    m = _save(tmp_path, "process", writer_nice=19)
    try:
        writers = [c for c in psutil.Process().children(recursive=True)
                   if "spawn_main" in " ".join(c.cmdline()) and c.is_running()]  # not the resource tracker
        assert writers, "no background writer process was started"
        assert {n for w in writers for n in _nice_of_threads(w.pid)} == {19}
        assert _nice_of_threads(os.getpid()) == {BASE}
        assert m.list()[-1].committed
    finally:
        m.close()


def test_thread_mode_never_renices(tmp_path):
    m = _save(tmp_path, "thread", writer_nice=19)
    m.close()
    assert _nice_of_threads(os.getpid()) == {BASE}


@pytest.mark.skipif(BASE > 12, reason="the suite already runs nicer than the values this test sets")
def test_renice_never_raises_priority_and_zero_does_nothing():
    """A thread already nicer than asked stays as it is (raising priority needs privileges)."""
    import threading

    out: dict[str, int] = {}

    def worker() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, 12)
        renice_threads(5)
        out["after_5"] = os.getpriority(os.PRIO_PROCESS, 0)
        renice_threads(0)
        out["after_0"] = os.getpriority(os.PRIO_PROCESS, 0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out == {"after_5": 12, "after_0": 12}


@pytest.mark.parametrize("bad", [-1, 20, 1.5, "10"])
def test_writer_nice_is_validated(tmp_path, bad):
    with pytest.raises(SettingError, match="writer_nice"):
        CheckpointManager(str(tmp_path), writer_nice=bad, handle_preemption=False, env={}, argv=[])
