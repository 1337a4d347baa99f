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


METADATA = sorted((HERE / "dcp_metadata").glob("torch*/*.metadata"))


def test_dcp_metadata_of_every_torch_release_loads():
    """DCP's .metadata as torch 2.6 to 2.14 write it (a state with every kind of entry) passes the allowlist."""
    from torch.distributed.checkpoint.metadata import Metadata

    from ckpt_core.safe_pickle import load_dcp_metadata

    versions = {p.parent.name for p in METADATA}
    assert {f"torch2.{m}" for m in range(6, 15)} <= {v.rsplit(".", 1)[0] for v in versions}
    for path in METADATA:
        assert isinstance(load_dcp_metadata(path.read_bytes(), str(path)), Metadata), path


def test_allowlist_is_exactly_what_torch_writes():
    """Every global the unpickler admits (dtypes aside) is one that some torch release writes, and vice versa."""
    import io
    import pickle

    from ckpt_core.safe_pickle import ALLOWED_GLOBALS

    seen: set = set()

    class Recorder(pickle.Unpickler):  # plain pickle on the suite's own committed fixtures
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    for path in METADATA:
        Recorder(io.BytesIO(path.read_bytes())).load()

    def non_dtype(globals_: set) -> set:
        return {g for g in globals_ if not (g[0] == "torch" and isinstance(getattr(torch, g[1], None), torch.dtype))}

    assert non_dtype(set(ALLOWED_GLOBALS)) == non_dtype(seen)
    assert seen <= ALLOWED_GLOBALS
