"""Scripts written for stock ``save_state``/``load_state`` keep working with the plugin attached (real ``Accelerator``s).

The multi-process scenario runs ``examples/accelerate_save_state.py``, a
script in the pattern of Accelerate's ``examples/by_feature/checkpointing.py``
with the plugin attached, SIGKILLed inside an epoch and resumed from the
``step_<N>`` directory it named.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from conftest import EXAMPLES, kill_tree  # noqa: E402
from helpers_ckpt import assert_same_tree  # noqa: E402

SCRIPT = EXAMPLES / "accelerate_save_state.py"


def _launch(args: list[str], nproc: int) -> subprocess.Popen:
    from conftest import REPO, free_port

    cmd = [sys.executable, str(SCRIPT), *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
        "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), *args]
    # the background writer in a thread: process mode is covered by test_accelerate_multiproc.py
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CKPT_ASYNC_MODE": "thread"}
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        kill_tree(proc.pid)
    return proc.returncode, err


def _losses(prefix: Path) -> dict[int, str]:
    return {int(s): v for s, v in (line.split() for line in Path(f"{prefix}.losses").read_text().splitlines())}


@pytest.mark.parametrize("nproc, every, kill_at, resume", [
    (1, 6, 14, 12),  # 8 batches an epoch: step 12 is batch 4 of epoch 1
    (2, 3, 7, 6),    # 4 batches an epoch per process: step 6 is batch 2 of epoch 1
])
def test_by_feature_pattern_resumes_bit_exact_across_the_epoch_boundary(tmp_path, nproc, every, kill_at, resume):
    """Killed after step ``kill_at``, resumed from ``step_<resume>`` skipping the epoch's first batches with the
    example's ``continue`` and (one process) with ``accelerator.skip_first_batches``."""
    skips = ["loop", "first_batches"] if nproc == 1 else ["loop"]
    every_arg = ["--checkpointing_steps", str(every)]
    base = _launch(["--output_dir", str(tmp_path / "base"), "--record", str(tmp_path / "base"), *every_arg], nproc)
    out = tmp_path / "out"
    killed = _launch(["--output_dir", str(out), "--record", str(tmp_path / "killed"), "--kill-at-step",
                      str(kill_at), *every_arg], nproc)
    rc, err = _finish(killed)
    assert rc != 0, err[-3000:]
    # save_state(out/step_<N>) wrote the checkpoint in that directory, complete when it returned
    assert (out / f"step_{resume}" / "manifest.json").exists()
    assert not list((out / f"step_{resume}").glob("step_*"))
    resumed = {}
    for skip in skips:
        shutil.copytree(out, tmp_path / f"out_{skip}")
        resumed[skip] = _launch(["--output_dir", str(tmp_path / f"out_{skip}"), "--record",
                                 str(tmp_path / f"resumed_{skip}"), "--resume_from_checkpoint",
                                 str(tmp_path / f"out_{skip}" / f"step_{resume}"), "--skip", skip, *every_arg], nproc)
    for skip, proc in resumed.items():
        rc, err = _finish(proc)
        assert rc == 0, err[-3000:]
        assert err.count("accelerate_ckpt: resumed from step") == 1  # one line, from the main process
    rc, err = _finish(base)
    assert rc == 0, err[-3000:]
    ref = _losses(tmp_path / "base")
    for skip in skips:
        got = _losses(tmp_path / f"resumed_{skip}")
        assert sorted(got) == [s for s in sorted(ref) if s > resume], skip  # the rest of epoch 1, epochs 2, 3
        assert [s for s in got if got[s] != ref[s]] == [], skip
        assert_same_tree(torch.load(f"{tmp_path / 'base'}.pt", weights_only=True),
                         torch.load(f"{tmp_path / f'resumed_{skip}'}.pt", weights_only=True))


# ------------------------------------------------------------------ in one process, real Accelerators
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from accelerate_ckpt import Accelerator, CheckpointPlugin  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_accelerate():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def build(plugin: CheckpointPlugin, **acc_kwargs):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, checkpoint_plugin=plugin, **acc_kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(40, 4)
    dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    return acc, model, opt, dl


def steps(acc, model, opt, batches, n: int) -> None:
    for i, (x, y) in enumerate(batches):
        if i == n:
            break
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def plugin(**kw) -> CheckpointPlugin:
    return CheckpointPlugin(env={}, argv=[], handle_preemption=False, **kw)


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("second_accelerator", [False, True])
def test_load_of_a_directory_waits_for_the_save_still_writing_it(tmp_path, second_accelerator):
    """async_save_state=True: save_state returns while the save writes; load_state(d) right after, by the same or
    another Accelerator of the process, waits for it and loads it, instead of failing."""
    p = plugin(async_mode="thread", async_save_state=True, storage_options={"control": str(tmp_path / "slow.json")})
    (tmp_path / "slow.json").write_text('{"delay_per_file_s": 0.3}')
    acc, model, opt, dl = build(p)
    steps(acc, model, opt, dl, 3)
    saved = params(model)
    target = f"faulty://{tmp_path / 'd'}"
    assert acc.save_state(target) == target
    assert p.writing_paths() == [target] and not (tmp_path / "d" / "manifest.json").exists()
    if second_accelerator:
        other = plugin(storage_options={"control": str(tmp_path / "slow.json")})
        acc, model, opt, dl = build(other)
    steps(acc, model, opt, dl, 2)
    acc.load_state(target)
    assert (tmp_path / "d" / "manifest.json").exists() and p.writing_paths() == []
    assert all(torch.equal(a, b) for a, b in zip(params(model), saved))


def test_save_state_is_complete_when_it_returns_and_replaces_a_directory_only_once_committed(tmp_path):
    """Stock scripts copy or upload right after save_state: the checkpoint is committed when it returns. Saving
    again into the same directory replaces it; what it held is deleted only after the new one committed."""
    p = plugin()
    acc, model, opt, dl = build(p)
    d = tmp_path / "latest"
    acc.save_state(str(d))
    assert (d / "manifest.json").exists()
    first = (d / "manifest.json").read_text()
    steps(acc, model, opt, dl, 2)
    after = params(model)
    acc.save_state(str(d))
    assert (d / "manifest.json").read_text() != first
    # nothing left aside; the plugin's run still holds the lease on the root (a hidden file, deleted at its end)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt-lease.000000000001.json", "latest"]
    steps(acc, model, opt, dl, 2)
    acc.load_state(str(d))
    assert all(torch.equal(a, b) for a, b in zip(params(model), after))


def test_a_failed_save_keeps_what_the_directory_held(tmp_path):
    control = tmp_path / "faults.json"
    control.write_text("{}")
    p = plugin(on_save_error="raise", write_retries=0, storage_options={"control": str(control)})
    acc, model, opt, dl = build(p)
    target = f"faulty://{tmp_path / 'd'}"
    acc.save_state(target)
    kept = params(model)
    steps(acc, model, opt, dl, 2)
    control.write_text('{"fail_after_bytes": 10}')
    from ckpt_core import SaveError

    with pytest.raises(SaveError):
        acc.save_state(target)
    aside = [q for q in tmp_path.iterdir() if q.name.startswith("d.replaced-")]
    assert len(aside) == 1 and (aside[0] / "manifest.json").exists()  # the committed checkpoint, intact
    control.write_text("{}")
    acc.load_state(f"faulty://{aside[0]}")
    assert all(torch.equal(a, b) for a, b in zip(params(model), kept))


def test_automatic_naming_uses_stock_names_limit_and_refuses_an_existing_checkpoint(tmp_path):
    pc = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc, model, opt, dl = build(plugin(), project_config=pc)
    for _ in range(4):
        steps(acc, model, opt, dl, 1)
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".ckpt-lease.000000000001.json", "checkpoint_2",
                                                           "checkpoint_3"]  # the lease: while the plugin runs
    acc.project_configuration.iteration = 3
    with pytest.raises(ValueError, match="checkpoint_3 .* already exists"):
        acc.save_state()


def test_len_of_the_training_loader_keeps_its_stock_meaning_after_a_resume(tmp_path):
    p = plugin(dirpath=str(tmp_path / "ck"), every_n_steps=4, async_mode="off")
    acc, model, opt, dl = build(p)
    assert len(dl) == 10
    for i, (x, y) in enumerate(p.dataloader(dl)):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        p.step()
        if i == 5:
            break
    p.close()
    p = plugin(dirpath=str(tmp_path / "ck"))
    acc, model, opt, dl = build(p)
    assert p.resume().step == 4
    wrapped = p.dataloader(dl)
    assert len(dl) == len(wrapped) == 10  # batches of an epoch, as without the plugin
    assert wrapped.remaining == 6 and sum(1 for _ in wrapped) == 6
    p.close()


def test_the_resume_notice_is_one_line_without_logging_configured(tmp_path, capfd):
    p = plugin(dirpath=str(tmp_path / "ck"), async_mode="off")
    acc, model, opt, dl = build(p)
    acc.save_state()
    p.close()
    capfd.readouterr()
    p = plugin(dirpath=str(tmp_path / "ck"))
    acc, model, opt, dl = build(p)
    acc.load_state()
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "accelerate_ckpt: resumed" in line] == [
        f"accelerate_ckpt: resumed from step 0 (epoch 0) at {tmp_path / 'ck' / 'step_000000000'}, saved by 1 "
        "process(es), now 1"]
    p.close()


def test_attaching_to_a_transformers_trainer_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x, labels=None):
            out = self.lin(x)
            return {"loss": (out - labels).pow(2).mean(), "logits": out}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = transformers.Trainer(model=Tiny(), args=args)
    with pytest.raises(NotImplementedError, match="Accelerator of a Trainer"):
        plugin(dirpath=str(tmp_path / "ck")).attach(trainer.accelerator)
    assert getattr(trainer.accelerator, "checkpoint_plugin", None) is None
