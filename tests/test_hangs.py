"""Bounded hangs: a rank that dies or hangs during a save or a restore makes the others fail within
``collective_timeout_s``, naming the step and the rank (``ckpt_core.rank_loss``); real processes, one per rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, WORKERS, free_port
from ckpt_core.errors import SaveError
from ckpt_core.rank_loss import RankLostError, is_collective_failure
from ckpt_core.discovery import list_records


def _launch(root, world: int, *args: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "rank_loss_worker.py"), "--root", str(root), *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True))  # each rank and its writer process: one "node"
    return procs


def _survivors(procs: list[subprocess.Popen], lost: int = 1) -> dict[int, tuple[int, str]]:
    out = {}
    try:
        for rank, p in enumerate(procs):
            if rank != lost:
                stdout, stderr = p.communicate(timeout=150)  # gloo's own default would be 30 minutes
                out[rank] = (p.returncode, stdout + stderr)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return out


def _assert_lost(result: dict[int, tuple[int, str]], what: str) -> None:
    for rank, (code, said) in result.items():
        lost = [line for line in said.splitlines() if line.startswith("LOST ")]
        assert code == 3 and lost, (rank, said[-3000:])
        seconds, message = float(lost[0].split()[1]), lost[0]
        assert what in message and "rank 1 did not answer" in message and "collective_timeout_s=5" in message
        assert seconds < 40, (rank, seconds)  # the 5 s timeout, the roll call (5 s), slack for a loaded machine


@pytest.mark.timeout(240)
def test_a_node_that_hangs_during_a_save_of_4_ranks_fails_the_others_within_the_timeout(tmp_path):
    """Rank 1 and its writer process stop (SIGSTOP: sockets stay open, as when a node hangs) while step 20 is
    written by the background processes: ranks 0, 2, 3 raise RankLostError naming step 20 and rank 1; step 10
    stays the newest committed checkpoint."""
    root = tmp_path / "run"
    result = _survivors(_launch(root, 4, "--scenario", "save", "--fault", "stop", "--mode", "process"))
    _assert_lost(result, "the checkpoint save at step 20 cannot complete")
    assert [r.step for r in list_records(str(root)) if r.committed] == [10]


@pytest.mark.timeout(240)
def test_a_rank_killed_during_a_restore_fails_the_other_at_once(tmp_path):
    """Rank 1's process group is SIGKILLed while step 10 is read back: rank 0 does not fall back to older
    checkpoints or wait; it raises RankLostError naming the restore of step 10 and rank 1."""
    root = tmp_path / "run"
    result = _survivors(_launch(root, 2, "--scenario", "restore", "--fault", "kill", "--mode", "thread"))
    _assert_lost(result, "the checkpoint restore at step 10 cannot complete")
    assert "falling back" not in result[0][1]


def test_collective_failures_are_told_apart_from_storage_errors():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for recv operation")
    assert is_collective_failure(gloo) and is_collective_failure(timed_out)
    assert is_collective_failure(SaveError(20, gloo))  # through the save's error
    assert is_collective_failure(torch.distributed.DistNetworkError("store unreachable"))
    for storage in (ConnectionResetError(104, "Connection reset by peer"), OSError(28, "No space left on device"),
                    RuntimeError("Timed out waiting for S3"), SaveError(20, TimeoutError("read timed out"))):
        assert not is_collective_failure(storage), storage


def test_the_error_says_what_to_do():
    err = RankLostError("save", 20, [1, 3], RuntimeError("gloo: Timed out"), 300.0)
    assert str(err).startswith("the checkpoint save at step 20 cannot complete: ranks 1, 3 did not answer")
    assert "collective_timeout_s=300" in str(err) and "Restart the job" in str(err)
    assert "could not be named" in str(RankLostError("restore", None, None, RuntimeError("x"), 5.0))
