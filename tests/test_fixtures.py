"""Every committed checkpoint fixture (one per torch version and manifest version) restores exactly.

The fixtures under ``tests/fixtures/checkpoints/`` were written by earlier
torch and ckpt versions (``tests/fixtures/fixture_state.py``); an upgrade that
strands them fails here.
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(HERE))

import fixture_state as F  # noqa: E402

from ckpt_core import CheckpointManager, TrainState  # noqa: E402

FIXTURES = sorted(p for p in (HERE / "checkpoints").iterdir() if p.is_dir())


def test_there_is_a_fixture_per_manifest_version():
    from ckpt_core.manifest import FORMAT_VERSION

    versions = {int(p.name.rsplit("manifest", 1)[1]) for p in FIXTURES}
    assert versions == set(range(1, FORMAT_VERSION + 1))


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.name for p in FIXTURES])
def test_fixture_restores_exactly(fixture: Path, tmp_path: Path):
    root = tmp_path / "root"
    shutil.copytree(fixture, root)  # restore may write next to a checkpoint: never touch the committed copy
    model, opt, sched = F.build(values=False)
    state = TrainState(model=model, optimizers=opt, schedulers=sched)
    random.seed(0)
    torch.manual_seed(0)
    with CheckpointManager(str(root), async_mode="off") as mgr:
        rec = mgr.restore(state)
    assert rec is not None and rec.step == F.STEP
    assert (state.step, state.epoch) == (F.STEP, F.EPOCH)
    for k, p in enumerate(model.parameters()):
        assert torch.equal(p.detach(), F.expected_param(k, p.shape))
        assert torch.equal(opt.state[p]["momentum_buffer"], F.expected_momentum(k, p.shape))
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.125
    draws = (torch.rand(4), random.random(), np.random.rand())
    F.seed_all()
    assert torch.equal(draws[0], torch.rand(4))
    assert draws[1:] == (random.random(), np.random.rand())
