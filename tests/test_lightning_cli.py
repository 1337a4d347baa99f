"""LightningCLI as a user runs it (a real subprocess): CKPT_* variables, --trainer.callbacks.settings.*, the saved
config.yaml relaunched, and a misspelt variable that fails loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from ckpt_core import list_records  # noqa: E402
from ckpt_core.export import export_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "examples" / "lightning_cli.py"


def cli_command(tmp: Path, env: dict, *args: str) -> dict:
    """``subprocess`` arguments of one ``examples/lightning_cli.py fit`` run, without inherited CKPT_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    return dict(args=[sys.executable, str(CLI), "fit", *args, "--trainer.logger=false",
                      "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu",
                      "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp}"],
                text=True, cwd=REPO, env={**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})


def cli(tmp: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(**cli_command(tmp, env, *args), capture_output=True, timeout=180)


def model_weights(checkpoint: Path, tmp: Path) -> dict:
    out = tmp / f"{checkpoint.parent.name}_{checkpoint.name}.pt"
    export_model(str(checkpoint), str(out), format="torch")
    return torch.load(out, weights_only=True)


def test_environment_and_settings_reach_the_callback_and_the_saved_config_relaunches(tmp_path):
    """Stopped at step 6 (mid-epoch: 10 steps an epoch), relaunched from the saved config.yaml to step 8: the
    model at step 8 is bit for bit the one of a run that went to 8 without stopping."""
    root, ref_dir = tmp_path / "ck", tmp_path / "ref"
    ours = ("--seed_everything=1234", "--trainer.callbacks+=lightning_ckpt.DistributedCheckpoint")
    ref = subprocess.Popen(**cli_command(ref_dir, {"CKPT_EVERY_N_STEPS": "4"}, *ours,
                                         f"--trainer.callbacks.dirpath={ref_dir / 'ck'}", "--trainer.max_steps=8"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = cli(tmp_path, {"CKPT_EVERY_N_STEPS": "2"}, *ours,
                f"--trainer.callbacks.dirpath={root}", "--trainer.callbacks.settings.keep_last=2",
                "--trainer.max_steps=6")
    assert first.returncode == 0, first.stderr[-4000:]
    assert [r.step for r in list_records(str(root)) if r.committed] == [4, 6]
    assert "[env CKPT_EVERY_N_STEPS]" in first.stderr  # the start-up line, at Lightning's default level
    config = tmp_path / "config.yaml"
    assert "keep_last: 2" in config.read_text()
    second = cli(tmp_path, {"CKPT_EVERY_N_STEPS": "2"}, f"--config={config}", "--trainer.max_steps=8")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from step 6" in second.stderr
    assert [r.step for r in list_records(str(root)) if r.committed] == [6, 8]
    _, err = ref.communicate(timeout=180)
    assert ref.returncode == 0, err[-4000:]
    resumed, uninterrupted = (model_weights(r / "step_000000008", tmp_path) for r in (root, ref_dir / "ck"))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_a_misspelt_variable_stops_the_run(tmp_path):
    proc = cli(tmp_path, {"CKPT_EVRY_N_STEPS": "2"}, "--trainer.callbacks+=lightning_ckpt.DistributedCheckpoint",
               f"--trainer.callbacks.dirpath={tmp_path / 'ck'}", "--trainer.max_steps=2")
    assert proc.returncode != 0
    assert "CKPT_EVRY_N_STEPS" in proc.stderr and "did you mean CKPT_EVERY_N_STEPS" in proc.stderr
    assert not (tmp_path / "ck").exists()
