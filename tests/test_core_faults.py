"""Faults on storage: restore skips every broken checkpoint, says why, and loads the previous valid one."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import crc32c
import pytest
import torch
from torch import nn

from ckpt_core import CheckpointManager, RestoreError, StateMismatchError, TrainState


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model, opt) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def three(tmp_path: Path):
    """Checkpoints at steps 10, 20, 30 with distinct weights; returns (root, {step: weights})."""
    root = tmp_path / "ckpts"
    model, opt = _model()
    state = TrainState(model=model, optimizers=opt)
    weights = {}
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        for step in (10, 20, 30):
            _train_step(model, opt)
            m.save(step, state)
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return root, weights


def _restore(root: Path, verify: str = "size"):
    model, opt = _model(seed=99)
    state = TrainState(model=model, optimizers=opt)
    with CheckpointManager(str(root), async_mode="off", verify=verify, handle_preemption=False) as m:
        info = m.restore(state)
    return info, model


def _shard(root: Path, step: int) -> Path:
    return next((root / f"step_{step:09d}").glob("*.distcp"))


def _assert_weights(model: nn.Module, expected: dict) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_newest_valid_is_restored(three):
    root, weights = three
    info, model = _restore(root)
    assert info.step == 30
    _assert_weights(model, weights[30])


def test_missing_manifest_is_never_loaded(three):
    root, weights = three
    (root / "step_000000030" / "manifest.json").unlink()
    info, model = _restore(root)
    assert info.step == 20
    _assert_weights(model, weights[20])


def test_truncated_shard_falls_back_with_reason(three):
    root, weights = three
    shard = _shard(root, 30)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.warns(UserWarning, match=r"step 30.*__0_0\.distcp has \d+ bytes, the manifest says \d+"):
        info, model = _restore(root)
    assert info.step == 20
    _assert_weights(model, weights[20])


def test_flipped_byte_is_caught_by_checksum(three):
    root, weights = three
    shard = _shard(root, 30)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step 30.*__0_0\.distcp.* fail.* checksum"):
        info, model = _restore(root, verify="checksum")
    assert info.step == 20
    _assert_weights(model, weights[20])


def test_flipped_tensor_byte_without_checksum_is_caught_by_fingerprint(three):
    """verify='size' does not read data, but the fingerprint check still refuses a changed tensor."""
    root, weights = three
    raw = weights[30]["0.weight"].numpy().tobytes()
    shard = next(f for f in sorted((root / "step_000000030").glob("*.distcp")) if raw in f.read_bytes())
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(raw)
    data[at + 5] ^= 0x40  # one bit inside the saved 0.weight values
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step 30.*(fingerprint|loading failed)"):
        got, model = _restore(root, verify="size")
    assert got.step == 20
    _assert_weights(model, weights[20])


def test_deleted_dcp_metadata_falls_back(three):
    root, weights = three
    (root / "step_000000030" / ".metadata").unlink()
    with pytest.warns(UserWarning, match=r"step 30.*\.metadata is missing"):
        info, model = _restore(root)
    assert info.step == 20


def test_garbage_manifest_is_skipped_with_warning(three):
    root, weights = three
    (root / "step_000000030" / "manifest.json").write_text("{not json")
    with pytest.warns(UserWarning, match=r"step 30.*manifest.json.*not valid JSON"):
        info, model = _restore(root)
    assert info.step == 20
    _assert_weights(model, weights[20])


def test_newer_manifest_version_is_refused(three):
    root, weights = three
    path = root / "step_000000030" / "manifest.json"
    body = json.loads(path.read_text())
    body["version"] = 99
    path.write_text(json.dumps(body))
    with pytest.warns(UserWarning, match=r"version 99 is newer than this library understands"):
        info, _ = _restore(root)
    assert info.step == 20


def test_all_broken_raises_clear_error(three):
    root, _ = three
    for step in (10, 20, 30):
        _shard(root, step).unlink()
    with pytest.warns(UserWarning):
        with pytest.raises(RestoreError, match=r"no checkpoint under .* could be restored \(tried steps \[30, 20, 10\]\)"):
            _restore(root)


def test_empty_root_starts_fresh(tmp_path: Path, caplog):
    model, opt = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        with CheckpointManager(str(tmp_path / "nothing"), async_mode="off", handle_preemption=False) as m:
            assert m.restore(TrainState(model=model, optimizers=opt)) is None
    assert not caplog.records
    _assert_weights(model, before)


def test_requested_step_that_does_not_exist(three):
    root, _ = three
    model, opt = _model()
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        with pytest.raises(RestoreError, match="no committed checkpoint at step 15"):
            m.restore(TrainState(model=model, optimizers=opt), step=15)


def test_checkpoint_of_another_model_names_the_keys(three):
    root, _ = three
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        with pytest.raises(StateMismatchError) as err:
            m.restore(TrainState(model=other))
    msg = str(err.value)
    assert "missing keys: 3.bias, 3.weight" in msg
    assert "unexpected keys" not in msg
    assert "mismatched shapes: 0.bias: checkpoint (8,), model (16,)" in msg
    _assert_weights(other, before)  # nothing applied


def test_committed_checkpoint_is_never_overwritten(three):
    root, weights = three
    model, opt = _model(seed=5)
    manifest = (root / "step_000000030" / "manifest.json").read_bytes()
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        m.restore(TrainState(model=model, optimizers=opt))
        _train_step(model, opt)
        assert m.save(30, TrainState(model=model, optimizers=opt)) is False
    assert (root / "step_000000030" / "manifest.json").read_bytes() == manifest


def test_no_unpickling_of_arbitrary_objects(three, tmp_path):
    """A .metadata carrying a pickled callable is refused, not executed."""
    import pickle

    root, _ = three
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Evil())
    (root / "step_000000030" / ".metadata").write_bytes(payload)
    m = json.loads((root / "step_000000030" / "manifest.json").read_text())
    m["files"][".metadata"] = {"size": len(payload), "crc32c": crc32c.crc32c(payload)}  # a forger recomputes it
    (root / "step_000000030" / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="global posix.system, which is not DCP checkpoint metadata"):
        info, _ = _restore(root)
    assert info.step == 20
    assert not marker.exists()


@pytest.mark.parametrize("kwargs,message", [
    ({"every_n_steps": 0}, "every_n_steps=0 is invalid: expected a positive integer"),
    ({"async_mode": "fast"}, "async_mode='fast' is invalid: expected one of bytes, process, thread, off"),
    ({"verify": "md5"}, "verify='md5' is invalid"),
    ({"interval": "auto"}, "device_mtbf_hours=None is invalid"),
    ({"keep_last": -1}, "keep_last=-1 is invalid"),
])
def test_invalid_arguments_fail_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CheckpointManager(str(tmp_path), **kwargs)
