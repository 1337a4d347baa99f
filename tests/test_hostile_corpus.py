"""The committed corpus of hostile files (``tests/fixtures/hostile/``): every parser refuses each one cleanly,
and a real restore of a checkpoint carrying one never runs code and never crashes."""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path

import pytest

import hostile
from ckpt_core import CheckpointManager, RestoreError, TrainState
from ckpt_core.manifest import ManifestError, parse_manifest
from ckpt_core.safe_pickle import load_dcp_metadata
from ckpt_core.sidecar import SidecarError, parse_sidecar

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import fixture_state as F  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "fixtures" / "hostile"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "torch2.13.0-manifest2"
MARKER = Path("/tmp/ckpt-hostile-corpus-pwned")


def _files(prefix: str) -> list[Path]:
    return sorted(CORPUS.glob(f"{prefix}-*"))


@pytest.fixture(autouse=True)
def no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "a hostile file ran code"


def test_corpus_is_complete():
    assert len(_files("manifest")) >= 20 and len(_files("sidecar")) >= 5 and len(_files("metadata")) >= 25


@pytest.mark.parametrize("path", _files("manifest"), ids=lambda p: p.stem)
def test_manifest_corpus(path):
    with pytest.raises(ManifestError):
        parse_manifest(path.read_bytes())


@pytest.mark.parametrize("path", _files("sidecar"), ids=lambda p: p.stem)
def test_sidecar_corpus(path):
    with pytest.raises(SidecarError):
        parse_sidecar(path.read_bytes())


@pytest.mark.parametrize("path", _files("metadata"), ids=lambda p: p.stem)
def test_metadata_corpus(path):
    with pytest.raises(pickle.UnpicklingError):
        load_dcp_metadata(path.read_bytes(), str(path))


def _restore_with(tmp_path: Path, name: str, data: bytes, forge: bool) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    ckpt = root / "step_000000007"
    if forge:
        hostile.forge_file(ckpt, name, data)
    else:
        (ckpt / name).write_bytes(data)
    model, opt, sched = F.build(values=False)
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        with pytest.raises(RestoreError, match="no checkpoint under .* could be restored"):
            with pytest.warns(UserWarning, match="step_000000007"):
                m.restore(TrainState(model=model, optimizers=opt, schedulers=sched))


@pytest.mark.parametrize("path", _files("metadata") + _files("sidecar"), ids=lambda p: p.stem)
def test_restore_of_a_checkpoint_carrying_corpus_files(path, tmp_path):
    name = ".metadata" if path.name.startswith("metadata") else "__0_.ckptpart.json"
    _restore_with(tmp_path, name, path.read_bytes(), forge=True)
    _restore_with(tmp_path / "unforged", name, path.read_bytes(), forge=False)


@pytest.mark.parametrize("path", _files("manifest"), ids=lambda p: p.stem)
def test_restore_with_corpus_manifest(path, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    shutil.copy(path, root / "step_000000007" / "manifest.json")
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        with pytest.warns(UserWarning, match="step_000000007.*is skipped: unusable manifest"):
            assert m.restore(TrainState()) is None


def test_every_prefix_of_a_real_metadata_is_refused_naming_the_file(tmp_path):
    """A ``.metadata`` cut anywhere is refused with an error that names it (pickle's own errors name no file)."""
    from ckpt_core import CheckpointManager, TrainState
    from torch import nn

    m = CheckpointManager(str(tmp_path / "run"), async_mode="off", env={}, argv=[])
    m.save(1, TrainState(model=nn.Linear(4, 4)))
    m.close()
    real = (tmp_path / "run" / "step_000000001" / ".metadata").read_bytes()
    for cut in range(0, len(real), max(1, len(real) // 200)):
        with pytest.raises(pickle.UnpicklingError, match=r"step_1/\.metadata"):
            load_dcp_metadata(real[:cut], "step_1/.metadata")
