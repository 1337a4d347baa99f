"""accelerate_ckpt end to end: examples/accelerate_train.py as real processes, killed with SIGKILL, resumed.

* bit-exact mid-epoch resume at 1 and 2 processes, with a plain shuffled
  DataLoader (the killed and the resumed run in the default async mode, DCP's
  background process) and with torchdata's
  StatefulDataLoader (``use_stateful_dataloader``; ``--ckpt.async_mode thread``
  given as a script flag): the per-step losses (exact floats), the samples of
  every step and the final weights (``torch.equal``) of the uninterrupted run
  and of the killed-then-resumed run are identical, on every rank;
* resharding: a run killed at 2 processes resumes at 1 and at 3 and continues
  the global data order: the samples seen in the interrupted epoch, before and
  after the change, are the dataset exactly once.

Multi-process runs use ``torchrun`` (``Accelerator(cpu=True)``: MULTI_CPU, gloo) on a free port.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kill_tree
from helpers_ckpt import assert_same_tree
import torch

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "accelerate_train.py"
SAMPLES, BATCH = 96, 4

# (steps, every_n_steps, kill_at_step) per process count: the kill lands in the second epoch,
# and with 2 processes every checkpoint leaves a multiple of 3 samples in its epoch (no padding at 3).
CONFIG = {1: (36, 5, 33), 2: (24, 3, 20), 4: (18, 5, 13)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, args: list[str], *, killed: bool = False, env: dict | None = None,
           timeout: float = 150) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(EXAMPLE), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if not k.startswith("CKPT_") or k in (env or {})}
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                             cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(popen.pid)
        stdout, stderr = popen.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s\n{stdout}\n{stderr[-6000:]}")
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if killed:  # SIGKILL: -9 for a lone process; torchrun reports the worker's -9 and exits 1
        assert proc.returncode == -signal.SIGKILL or (proc.returncode == 1 and "exitcode  : -9" in proc.stderr), (
            f"expected a SIGKILL, rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}")
    else:
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


def records(out: Path) -> dict[int, list[dict]]:
    result = {}
    for f in sorted(out.glob("rank*.jsonl")):
        result[int(f.stem[4:])] = [json.loads(line) for line in f.read_text().splitlines()]
    return result


def steps_of(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["event"] == "step"}


def start_of(events: list[dict]) -> dict:
    return [e for e in events if e["event"] == "start"][-1]


def run_args(dirpath: Path, out: Path, nproc: int, loader: str, extra: tuple = ()) -> list[str]:
    steps, every, _ = CONFIG[nproc]
    args = ["--dirpath", str(dirpath), "--out", str(out), "--steps", str(steps), "--every-n-steps", str(every),
            "--samples", str(SAMPLES), "--batch-size", str(BATCH)]
    if loader == "stateful":
        args += ["--stateful-dataloader", "--ckpt.async_mode", "thread"]
    if nproc >= 4:  # at 4 ranks a wider model makes an ulp of a differently ordered gradient sum certain to show
        args += ["--width", "256"]
    return args + list(extra)


@pytest.fixture(scope="module")
def plain2_killed(tmp_path_factory) -> tuple[Path, Path]:
    """A plain-loader run at 2 processes SIGKILLed at step 20; (its records, a pristine copy of its checkpoints)."""
    work = tmp_path_factory.mktemp("plain2")
    _, _, kill = CONFIG[2]
    launch(2, run_args(work / "ck", work / "killed", 2, "plain", ("--kill-at-step", str(kill))), killed=True)
    shutil.copytree(work / "ck", work / "pristine")
    return work / "killed", work / "pristine"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(nproc)``: the records of the uninterrupted plain-loader run at ``nproc`` processes, made once.

    Its saves run in a thread (cheaper to start); checkpointing never changes the numbers, and neither does the
    loader: a StatefulDataLoader draws the plain DataLoader's order, which the comparisons also show."""
    made: dict[int, Path] = {}

    def get(nproc: int) -> Path:
        if nproc not in made:
            work = tmp_path_factory.mktemp(f"ref{nproc}")
            launch(nproc, run_args(work / "ref_ck", work / "ref", nproc, "plain", ("--ckpt.async_mode", "thread")))
            made[nproc] = work / "ref"
        return made[nproc]

    return get


@pytest.mark.parametrize("loader,nproc", [("plain", 1), ("plain", 2), ("stateful", 1), ("stateful", 2), ("plain", 4)])
def test_bit_exact_mid_epoch_resume_after_sigkill(loader, nproc, tmp_path, request, reference):
    steps, every, kill = CONFIG[nproc]
    ref_out = reference(nproc)  # the uninterrupted run
    if (loader, nproc) == ("plain", 2):
        killed_out, pristine = request.getfixturevalue("plain2_killed")
        shutil.copytree(pristine, tmp_path / "ck")
    else:
        killed_out = tmp_path / "killed"
        # at 4 processes on 2 cores a background write can lag the kill: save synchronously there
        sync = ("--ckpt.async_mode", "off") if nproc >= 4 else ()
        launch(nproc, run_args(tmp_path / "ck", killed_out, nproc, loader, ("--kill-at-step", str(kill), *sync)),
               killed=True)
    launch(nproc, run_args(tmp_path / "ck", tmp_path / "resumed", nproc, loader))

    ref, killed, resumed = records(ref_out), records(killed_out), records(tmp_path / "resumed")
    assert sorted(ref) == sorted(killed) == sorted(resumed) == list(range(nproc))
    steps_per_epoch = SAMPLES // (BATCH * nproc)
    for rank in range(nproc):
        start = start_of(resumed[rank])
        r = start["resumed_from"]
        assert r is not None and r < kill and r % every == 0, start
        assert r % steps_per_epoch != 0 and start["epoch"] == r // steps_per_epoch == 1, "not mid-epoch 1"
        ref_steps, killed_steps, resumed_steps = steps_of(ref[rank]), steps_of(killed[rank]), steps_of(resumed[rank])
        assert max(killed_steps) == kill
        assert sorted(resumed_steps) == list(range(r + 1, steps + 1))
        for s, e in resumed_steps.items():
            assert (e["loss"], e["indices"], e["epoch"]) == (
                ref_steps[s]["loss"], ref_steps[s]["indices"], ref_steps[s]["epoch"]), f"rank {rank} step {s}"
        for s in range(1, r + 1):
            assert killed_steps[s] == ref_steps[s]
        end = resumed[rank][-1]
        assert end["event"] == "end" and end["step"] == steps
        if nproc == 1 and loader == "plain":
            # the default bytes mode needs no process group at one process: none is started, Accelerate runs as NO
            assert (end["distributed_type"], end["process_group"]) == ("NO", False)
        w_ref = torch.load(ref_out / f"final_rank{rank}.pt", weights_only=True)
        w = torch.load(tmp_path / "resumed" / f"final_rank{rank}.pt", weights_only=True)
        assert w.keys() == w_ref.keys() and all(torch.equal(w[k], w_ref[k]) for k in w)
        assert_same_tree(torch.load(ref_out / f"final_optim_rank{rank}.pt", weights_only=True),
                         torch.load(tmp_path / "resumed" / f"final_optim_rank{rank}.pt", weights_only=True))


@pytest.mark.parametrize("new_nproc", [1, 3])
def test_resume_at_another_process_count_continues_the_global_order(new_nproc, plain2_killed, tmp_path):
    killed_out, pristine = plain2_killed
    shutil.copytree(pristine, tmp_path / "ck")
    killed = records(killed_out)
    # enough steps to finish the interrupted epoch at the new process count
    steps = 24 + math.ceil(SAMPLES / (BATCH * new_nproc))
    args = ["--dirpath", str(tmp_path / "ck"), "--out", str(tmp_path / "resumed"), "--steps", str(steps),
            "--every-n-steps", "3", "--samples", str(SAMPLES), "--batch-size", str(BATCH)]
    proc = launch(new_nproc, args, env={"CKPT_ASYNC_MODE": "thread"})  # settings from the environment
    assert "RNG states were remapped" in proc.stderr
    resumed = records(tmp_path / "resumed")
    assert sorted(resumed) == list(range(new_nproc))
    starts = [start_of(resumed[rank]) for rank in range(new_nproc)]
    r, epoch = starts[0]["resumed_from"], starts[0]["epoch"]
    assert all((s["resumed_from"], s["epoch"], s["world_size"]) == (r, epoch, new_nproc) for s in starts)
    assert r is not None and epoch == 1 and r % 12 != 0  # mid-epoch 1 of the 2-process run

    seen = [i for rank in killed for s, e in steps_of(killed[rank]).items()
            if s <= r and e["epoch"] == epoch for i in e["indices"]]
    before = len(seen)
    assert before == (r - 12) * BATCH * 2
    seen += [i for rank in resumed for e in steps_of(resumed[rank]).values() if e["epoch"] == epoch
             for i in e["indices"]]
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, "not every sample exactly once"
    # training continued into the next epoch, to the last step, with finite losses
    for rank in range(new_nproc):
        rs = steps_of(resumed[rank])
        assert max(rs) == steps and sorted(rs) == list(range(r + 1, steps + 1))
        assert any(e["epoch"] == epoch + 1 for e in rs.values())
        assert all(math.isfinite(e["loss"]) for e in rs.values())


def test_process_group_outlives_the_ddp_model_after_end_training(tmp_path):
    """The script ends as Accelerate's examples do: ``end_training()`` destroys the process group, then the DDP
    model dies with ``main``. gloo's destructor must not run inside DDP's reducer (GIL held: a gloo worker that needs
    the GIL to free the last collective's tensor hung 4-rank runs at exit) but from Python, afterwards."""
    from conftest import WORKERS

    worker = WORKERS / "exit_order_worker.py"
    launch_args = [str(tmp_path / "facts"), str(EXAMPLE), "--dirpath", str(tmp_path / "ck"), "--steps", "6",
                   "--every-n-steps", "5", "--ckpt.async_mode", "thread"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(worker), *launch_args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        facts = json.loads((tmp_path / f"facts.rank{rank}.json").read_text())
        assert facts["held_after_main"] == 1 and facts["held_released"] == 0
        assert facts["threads_released"] < facts["threads_after_main"], facts  # gloo's threads ended on release
