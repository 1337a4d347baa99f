"""``DistributedCheckpoint`` end to end: real ``examples/lightning_train.py`` processes, killed and resumed.

Each scenario runs the example uninterrupted and, at the same time, a copy
that is SIGKILLed (or SIGTERMed) after a mid-epoch checkpoint; then resumes
the killed one. The losses from the restored step on (compared as exact
float hex strings) and the final parameters (``torch.equal``) must be the
uninterrupted run's. Multi-device runs are DDP or FSDP2 over gloo on CPU,
launched by Lightning itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import kill_tree
from helpers_ckpt import assert_same_tree

pytest.importorskip("lightning")

from ckpt_core import list_records  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "lightning_train.py"
MAX_STEPS, EVERY = 24, 4


class Run:
    """One example invocation (all its ranks and helper processes in one process group)."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out = out
        self.log_path = Path(f"{out}.log")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--out", str(out), *args], cwd=REPO,
                                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, expect_rc: int = 0, timeout: float = 300) -> "Run":
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(self.proc.pid)  # ranks, DCP writer processes: nothing of this run may outlive it
        text = self.log_path.read_text()
        assert rc == expect_rc, f"rc={rc}, expected {expect_rc}\n{text[-6000:]}"
        self.text = text
        return self

    @property
    def summary(self) -> dict:
        return json.loads(Path(f"{self.out}.json").read_text())

    @property
    def losses(self) -> dict[int, str]:
        with open(f"{self.out}.losses") as f:
            return {int(s): v for s, v in (line.split() for line in f)}

    def weights(self, tag: str = "weights") -> dict[str, torch.Tensor]:
        return torch.load(f"{self.out}.{tag}.pt", weights_only=True)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def exact_resume(tmp: Path, *args: str, kill_at: int, steps_per_epoch: int, base: Optional[Run] = None,
                 base_args: tuple[str, ...] = ("--async-mode", "thread"), async_mode: str = "thread",
                 max_steps: int = MAX_STEPS) -> Run:
    """Uninterrupted (``base``, started here unless given) vs SIGKILLed-then-resumed; returns the resumed run."""
    common = ["--max-steps", str(max_steps), "--every-n-steps", str(EVERY), *args]
    if base is None:
        base = Run(tmp / "base", "--dirpath", str(tmp / "base_ck"), *common, *base_args)
    run_args = [*common, "--async-mode", async_mode]
    killed = Run(tmp / "killed", "--dirpath", str(tmp / "ck"), "--kill-at-step", str(kill_at), *run_args)
    killed.finish(expect_rc=-signal.SIGKILL)
    resumed = Run(tmp / "resumed", "--dirpath", str(tmp / "ck"), *run_args).finish()
    base.finish()

    step = resumed.summary["resumed_from"]
    # the newest checkpoint committed before the kill (the one due just before may still have been writing)
    assert step is not None and step % EVERY == 0 and kill_at - 2 * EVERY <= step < kill_at, step
    assert step % steps_per_epoch != 0, f"step {step} is not mid-epoch"
    # where training ended, and the state of ModelCheckpoint/EarlyStopping when the run has them
    assert {k: v for k, v in resumed.summary.items() if k != "resumed_from"} == \
        {k: v for k, v in base.summary.items() if k != "resumed_from"}
    ref = base.losses
    # every step after the restored one (with gradient accumulation, batches before the next optimizer step
    # still report the restored step)
    assert {s for s in ref if s > step} <= set(resumed.losses) and min(resumed.losses) >= step
    assert all(killed.losses[s] == ref[s] for s in killed.losses if s < kill_at)  # the kill cuts kill_at's window
    diverged = [s for s, v in resumed.losses.items() if v != ref[s]]
    assert not diverged, f"losses differ from the uninterrupted run at steps {diverged}"
    assert_same_weights(base.weights(), resumed.weights())
    assert_same_tree(base.weights("optim"), resumed.weights("optim"))  # moments, step counts, LR schedules
    assert "resume check" not in resumed.text  # the core's own first-losses comparison agreed too
    return resumed


SINGLE = ("--val-every", "4")  # validation right after every checkpoint step (Lightning skips it on resume)


@pytest.fixture(scope="module")
def single_plain_baseline(tmp_path_factory) -> tuple[Path, Run]:
    """The uninterrupted single-device run with a plain shuffled DataLoader, shared by two tests."""
    tmp = tmp_path_factory.mktemp("single_plain")
    run = Run(tmp / "base", "--dirpath", str(tmp / "base_ck"), "--max-steps", str(MAX_STEPS),
              "--every-n-steps", str(EVERY), *SINGLE, "--csv-logs", str(tmp / "logs"))
    return tmp, run


def test_single_device_plain_dataloader_resumes_bit_exact(single_plain_baseline, tmp_path):
    base_dir, base = single_plain_baseline  # 80 samples / 8 = 10 steps an epoch
    exact_resume(tmp_path, *SINGLE, kill_at=15, steps_per_epoch=10, base=base)
    metrics = next((base_dir / "logs").rglob("metrics.csv")).read_text()
    assert "ckpt/blocking_s" in metrics and "ckpt/bytes" in metrics  # the core's save metrics reach the logger


@pytest.mark.parametrize("loader", ["stateful", "stream"])
def test_single_device_stateful_dataloader_resumes_bit_exact(tmp_path, loader):
    # "stateful": torchdata's StatefulDataLoader(shuffle=True) over the same map-style data (its sampler is
    # replaced as a DataLoader's); "stream": a StatefulDataLoader over an IterableDataset without length,
    # which keeps its own position, and which Lightning reads one batch ahead of training
    exact_resume(tmp_path, *SINGLE, "--loader", loader, kill_at=15, steps_per_epoch=10)


def test_gradient_accumulation_and_bf16_mixed_resume_bit_exact(tmp_path):
    """accumulate_grad_batches=4 (3 optimizer steps an epoch of 10 batches), bf16-mixed autocast, validation
    every 4 batches and a step-wise LR schedule: killed mid-epoch, resumed, identical to the uninterrupted run."""
    exact_resume(tmp_path, *SINGLE, "--accumulate", "4", "--precision", "bf16-mixed", kill_at=11,
                 steps_per_epoch=3)


def test_manual_optimization_with_model_checkpoint_and_early_stopping_resumes_bit_exact(tmp_path):
    """Two optimizers stepped by hand (global_step advances by 2 a batch), ModelCheckpoint(monitor='val_loss')
    and EarlyStopping beside ours. The checkpoint of step 16 is taken after the validation that follows it, so
    the resumed run holds that validation's top-k entry and patience count, as the uninterrupted run did:
    both stop early at the same step with the same best scores."""
    resumed = exact_resume(tmp_path, *SINGLE, "--manual", "--monitor", kill_at=18, steps_per_epoch=20,
                           async_mode="off", max_steps=48)
    assert resumed.summary["resumed_from"] == 16  # a checkpoint taken right after a validation
    assert resumed.summary["global_step"] < 48 and resumed.summary["es"]["wait"] == 3  # EarlyStopping stopped it
    assert sorted(p.name for p in Path(f"{tmp_path / 'ck'}.best").iterdir()) == [n for n, _ in
                                                                                 resumed.summary["best_k"]]


def test_sigterm_during_validation_saves_the_step_it_follows(single_plain_baseline, tmp_path):
    """SIGTERM while the validation after step 12 runs (no save due there: every 5 steps): step 12 is saved
    once that validation ends, the run exits 143, and the resume loses no step."""
    _, base = single_plain_baseline
    common = ["--max-steps", str(MAX_STEPS), *SINGLE]
    Run(tmp_path / "term", "--dirpath", str(tmp_path / "ck"), "--every-n-steps", "5", "--sigterm-in-validation",
        "12", *common).finish(expect_rc=143)
    assert [r.step for r in list_records(str(tmp_path / "ck")) if r.committed] == [5, 10, 12]
    resumed = Run(tmp_path / "resumed", "--dirpath", str(tmp_path / "ck"), "--every-n-steps", "5", *common).finish()
    base.finish()
    assert resumed.summary["resumed_from"] == 12
    assert sorted(resumed.losses) == list(range(13, MAX_STEPS + 1))
    assert [s for s, v in resumed.losses.items() if v != base.losses[s]] == []
    assert_same_weights(base.weights(), resumed.weights())


def test_sigterm_saves_at_the_step_boundary_and_resumes_bit_exact(single_plain_baseline, tmp_path):
    _, base = single_plain_baseline
    common = ["--max-steps", str(MAX_STEPS), "--every-n-steps", str(EVERY), *SINGLE]
    # SIGTERM after step 6's save check: Lightning stops at the end of that batch, step 6 is saved, exit 143
    Run(tmp_path / "term", "--dirpath", str(tmp_path / "ck"), "--sigterm-at-step", "6", *common).finish(expect_rc=143)
    resumed = Run(tmp_path / "resumed", "--dirpath", str(tmp_path / "ck"), *common).finish()
    base.finish()
    assert resumed.summary["resumed_from"] == 6
    assert sorted(resumed.losses) == list(range(7, MAX_STEPS + 1))
    ref = base.losses
    assert [s for s, v in resumed.losses.items() if v != ref[s]] == []
    assert_same_weights(base.weights(), resumed.weights())


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["plain", "stream"])
def test_ddp_resumes_bit_exact(tmp_path, loader):
    # 2 ranks x 8 = 16 samples a step: 5 steps an epoch. The plain baseline writes in the default
    # background process (the others in a thread): the numbers must not depend on it. The stream's
    # StatefulDataLoader state is per rank.
    base_args = () if loader == "plain" else ("--async-mode", "thread")
    exact_resume(tmp_path, "--devices", "2", "--strategy", "ddp", "--loader", loader, kill_at=15,
                 steps_per_epoch=5, base_args=base_args)


def test_ddp_resumes_bit_exact_at_4_devices(tmp_path):
    # 4 ranks x 4 = 16 samples a step: 6 steps an epoch. At 4 ranks the order of a gradient sum depends on
    # DDP's bucket layout, which the callback fixes before the first step in every run.
    exact_resume(tmp_path, "--devices", "4", "--strategy", "ddp", "--samples", "96", "--batch-size", "4",
                 kill_at=11, steps_per_epoch=6)


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_at_one_and_two_devices(tmp_path):
    fsdp = ["--strategy", "fsdp2", "--max-steps", "12", "--every-n-steps", "4", "--async-mode", "thread"]
    saved = Run(tmp_path / "saved", "--dirpath", str(tmp_path / "ck"), "--devices", "2", *fsdp,
                "--weights-at-step", "8").finish()
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    # 1 device: fit(ckpt_path=) names a checkpoint of another root, which is only read
    one = Run(tmp_path / "one", "--dirpath", str(tmp_path / "new"), "--devices", "1", *fsdp, "--weights-at-start",
              "--ckpt-path", str(tmp_path / "ck" / "step_000000008"))
    # 2 devices: a step of its own root (a rollback: newer checkpoints are moved aside)
    two = Run(tmp_path / "two", "--dirpath", str(tmp_path / "ck2"), "--devices", "2", *fsdp, "--weights-at-start",
              "--ckpt-path", str(tmp_path / "ck2" / "step_000000008"))
    one.finish()
    two.finish()

    at_8 = saved.weights("step8")
    for run in (one, two):
        assert run.summary["resumed_from"] == 8 and run.summary["global_step"] == 12
        assert_same_weights(at_8, run.weights("start"))  # resharded 2 -> 1 and 2 -> 2: the same numbers
        assert sorted(run.losses) == [9, 10, 11, 12]
    assert "not bit-exact" in one.text  # RNG remapped to the new world size, and it says so
    assert all(torch.isfinite(torch.tensor(float.fromhex(v))) for v in one.losses.values())
    assert [s for s, v in two.losses.items() if v != saved.losses[s]] == []
    assert_same_weights(saved.weights(), two.weights())

    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000004", "step_000000008",
                                                                  "step_000000012"]  # untouched
    assert (tmp_path / "new" / "step_000000012" / "manifest.json").exists()
    assert list((tmp_path / "ck2" / "rolled_back").rglob("step_000000012"))


def test_slurm_requeue_signal_to_one_rank_of_two(tmp_path):
    """A 2-task DDP job under ``SLURMEnvironment`` (auto-requeue on SIGUSR1): the signal reaches rank 1 only; both
    ranks save the same step and exit 143, rank 0 alone runs ``scontrol requeue`` (a fake on PATH records it), and
    the requeued job resumes from that checkpoint."""
    from conftest import WORKERS, free_port

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (fake / "scontrol").chmod(0o755)
    root, out = tmp_path / "ck", tmp_path / "run"

    def job(*extra: str) -> list[int]:
        port, procs = str(free_port()), []
        logs = [open(tmp_path / f"rank{rank}.log", "a") for rank in range(2)]  # shown when an exit code is wrong
        for rank in range(2):
            env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
                   "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
                   "SLURM_JOB_NAME": "train", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                   "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "MASTER_PORT": port}
            procs.append(subprocess.Popen([sys.executable, str(WORKERS / "slurm_worker.py"), "--root", str(root),
                                           "--out", str(out), *extra], env=env, cwd=REPO,
                                          stdout=logs[rank], stderr=subprocess.STDOUT))
        try:
            return [p.wait(timeout=150) for p in procs]
        finally:
            for p in procs:
                kill_tree(p.pid)
            for f in logs:
                f.close()

    codes = job("--signal-at", "5", "--signal-rank", "1", "--max-steps", "40")
    assert codes == [143, 143], [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2)]
    # the notice reached rank 1 at step 5; every rank learns of it at the same step boundary, at most 2 x 8 steps
    # later (maybe_save's flag exchange: every step for steps of 20 ms or more, every 8th at most), and saves it
    saved = [r.step for r in list_records(str(root)) if r.committed]
    assert len(saved) == 1 and 5 < saved[0] <= 5 + 2 * 8, saved
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert job("--max-steps", "40") == [0, 0]
    facts = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert [f["resumed_from"] for f in facts] == saved * 2 and [f["step"] for f in facts] == [40, 40]
