"""LightningCLI as a user runs it (a real subprocess): CKPT_* variables, --trainer.callbacks.settings.*, the saved
config.yaml relaunched, and a misspelt variable that fails loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from ckpt_core import list_records  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "examples" / "lightning_cli.py"


def cli(tmp: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    return subprocess.run(
        [sys.executable, str(CLI), "fit", *args, "--trainer.logger=false", "--trainer.enable_progress_bar=false",
         "--trainer.accelerator=cpu", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp}"],
        capture_output=True, text=True, timeout=180, cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})


def test_environment_and_settings_reach_the_callback_and_the_saved_config_relaunches(tmp_path):
    root = tmp_path / "ck"
    first = cli(tmp_path, {"CKPT_EVERY_N_STEPS": "2"}, "--trainer.callbacks+=lightning_ckpt.DistributedCheckpoint",
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


def test_a_misspelt_variable_stops_the_run(tmp_path):
    proc = cli(tmp_path, {"CKPT_EVRY_N_STEPS": "2"}, "--trainer.callbacks+=lightning_ckpt.DistributedCheckpoint",
               f"--trainer.callbacks.dirpath={tmp_path / 'ck'}", "--trainer.max_steps=2")
    assert proc.returncode != 0
    assert "CKPT_EVRY_N_STEPS" in proc.stderr and "did you mean CKPT_EVERY_N_STEPS" in proc.stderr
    assert not (tmp_path / "ck").exists()
