"""Trust: a checkpoint directory is untrusted input.

Loading never runs code from storage (an exact allowlist for ``.metadata``,
``weights_only`` for tensors and blobs, JSON for everything of ours), every
byte that is applied is checked at the default verification level, and no
damage or forgery ends in a crash: restore falls back to the previous good
checkpoint with a warning that names the checkpoint and the reason, and the
``ckpt`` commands end with one line and exit 1 (invalid) or 2 (not a
checkpoint).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import hostile
from ckpt_core import CheckpointManager, CheckpointRootError, RestoreError, SaveError, TrainState
from helpers_ckpt import restore_warned, run_cli as _cli, save_distinct, tiny_model

STEPS = (10, 20)


class _Box:
    """A Stateful extra whose state is whatever the test puts in it (e.g. an object that runs code when unpickled)."""

    def __init__(self, value: object = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def _state(seed: int = 0) -> tuple[TrainState, nn.Module]:
    model = tiny_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return TrainState(model=model, optimizers=opt, extra={"box": _Box()}), model


def _save(root: Path, steps=STEPS, **kwargs) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints at ``steps`` with distinct weights; returns the weights of each."""
    return save_distinct(root, *_state(), steps, **kwargs)


def _restore(root: Path, **kwargs):
    state, model = _state(seed=99)
    info, said = restore_warned(root, state, **kwargs)
    return info, model, state, said


def _assert_weights(model: nn.Module, expected: dict) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("integrity") / "run"
    return root, _save(root)


@pytest.fixture
def run(pristine, tmp_path) -> tuple[Path, dict]:
    """A fresh copy of checkpoints 10 and 20."""
    src, weights = pristine
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst, weights


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def _every_command(capsys, root: Path, ckpt: Path, tmp_path: Path) -> dict[str, int]:
    """Run every ``ckpt`` command on a hostile checkpoint; each ends with at most one line on stderr."""
    codes = {}
    for argv in (["ls", str(root)], ["inspect", str(ckpt)], ["verify", str(ckpt)], ["verify", str(ckpt), "--checksum"],
                 ["export", str(ckpt), str(tmp_path / "exported.safetensors")],
                 ["prune", str(root), "--keep-last", "1", "--dry-run"]):
        code, _, err = _cli(capsys, *argv)
        assert err.count("\n") <= 1, (argv, err)
        codes[" ".join(argv[:1] + [a for a in argv[1:] if a.startswith("--")])] = code
    return codes


def _assert_falls_back(root: Path, weights: dict, bad: int = 20, good: int = 10, reason: str = "") -> str:
    info, model, state, said = _restore(root)
    assert info is not None and info.step == good and state.step == good
    _assert_weights(model, weights[good])
    assert f"step {bad}" in said and ("not usable" in said or "is skipped" in said), said
    assert reason in said, said
    return said


# -------------------------------------------------------- hostile .metadata
PAYLOADS = sorted(hostile.metadata_payloads(Path("/nonexistent")))


@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_metadata_never_runs(payload, run, tmp_path, capsys):
    """A forger replaces step 20's .metadata (checksums recomputed): nothing runs, restore and the CLI refuse it."""
    from torch.distributed.checkpoint.metadata import Metadata

    root, weights = run
    marker = tmp_path / "pwned"
    ckpt = _ckpt(root, 20)
    real = (ckpt / ".metadata").read_bytes()
    hostile.forge_file(ckpt, ".metadata", hostile.metadata_payloads(marker)[payload](real))
    _assert_falls_back(root, weights, reason=".metadata")
    assert _cli(capsys, "inspect", str(ckpt))[0] == 1
    assert _cli(capsys, "verify", str(ckpt))[0] == 1
    code, out, _ = _cli(capsys, "verify", str(ckpt), "--checksum")
    assert code == 1 and "FAIL" in out
    assert _cli(capsys, "export", str(ckpt), str(tmp_path / "w.safetensors"))[0] == 1
    code, out, _ = _cli(capsys, "ls", str(root))
    assert code == 0 and "newest valid checkpoint (what a run resumes from): step 10" in out
    code, out, _ = _cli(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 0 and _ckpt(root, 10).exists()  # the newest *valid* checkpoint is never pruned
    assert not marker.exists()
    assert not hasattr(Metadata, "__hostile__")
    assert not (tmp_path / "w.safetensors").exists()


def test_tampered_metadata_without_forged_checksums_is_refused_before_unpickling(run, tmp_path):
    root, weights = run
    marker = tmp_path / "pwned"
    ckpt = _ckpt(root, 20)
    payload = hostile.metadata_payloads(marker)["dotted-name-via-dcp-filesystem+real"]
    (ckpt / ".metadata").write_bytes(payload((ckpt / ".metadata").read_bytes()))
    _assert_falls_back(root, weights, reason=".metadata has")
    assert not marker.exists()


def test_hostile_metadata_two_ranks(run, tmp_path):
    """At 2 ranks every rank refuses the payload and both fall back to the same checkpoint."""
    from conftest import WORKERS, run_script

    root, weights = run
    marker = tmp_path / "pwned"
    ckpt = _ckpt(root, 20)
    payload = hostile.metadata_payloads(marker)["dotted-name-via-dcp-filesystem+real"]
    hostile.forge_file(ckpt, ".metadata", payload((ckpt / ".metadata").read_bytes()))
    out = tmp_path / "out"
    proc = run_script(WORKERS / "restore_worker.py", ["--root", str(root), "--out", str(out)], nproc=2, torchrun=True)
    for rank in range(2):
        assert json.loads(Path(f"{out}.rank{rank}.json").read_text())["step"] == 10
    assert "step 20" in proc.stderr and "not DCP checkpoint metadata" in proc.stderr
    assert not marker.exists()


# ---------------------------------------------- hostile shards, blobs, sidecars
class _Evil:
    marker: Path = Path("/nonexistent")

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_hostile_blob_never_runs(tmp_path, capsys):
    """A writer put an object that runs code into the per-rank blob (extra state): weights_only refuses it."""
    root = tmp_path / "run"
    weights = _save(root, steps=(10,))
    marker = tmp_path / "pwned"
    _Evil.marker = marker
    state, model = _state()
    model.load_state_dict(weights[10])
    state.extra["box"].value = _Evil()
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        m.save(20, state)
    _assert_falls_back(root, weights, reason="does not decode")
    codes = _every_command(capsys, root, _ckpt(root, 20), tmp_path)
    assert codes["verify --checksum"] == 0  # well-formed files: only loading refuses
    assert not marker.exists()


class _EvilExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.payload: object = None

    def get_extra_state(self) -> object:
        return self.payload

    def set_extra_state(self, state: object) -> None:
        self.payload = state


def test_hostile_byte_item_never_runs(tmp_path, capsys):
    """A non-tensor DCP item (a module's extra state) that runs code when unpickled: refused, falls back."""
    root = tmp_path / "run"
    marker = tmp_path / "pwned"
    _Evil.marker = marker
    model = _EvilExtraState()
    state = TrainState(model=model)
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        model.payload = 1
        m.save(10, state)
        model.payload = _Evil()
        m.save(20, state)
    fresh = _EvilExtraState()
    with pytest.warns(UserWarning, match=r"step 20.*not usable.*(Weights only load failed|Unsupported)"):
        with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
            info = m.restore(TrainState(model=fresh))
    assert info.step == 10 and fresh.payload == 1
    code, out, _ = _cli(capsys, "export", str(_ckpt(root, 20)), str(tmp_path / "w.pt"))
    assert code == 0 and "skipped non-tensor entries: model._extra_state" in out  # never unpickled
    _every_command(capsys, root, _ckpt(root, 20), tmp_path)
    assert not marker.exists()


def test_forged_tensor_item_never_runs(run, tmp_path, capsys):
    """A forger replaces a tensor item with a torch.save of a payload and re-signs every checksum."""
    root, weights = run
    marker = tmp_path / "pwned"
    ckpt = _ckpt(root, 20)
    name, offset, length = hostile.item_of(ckpt, "model.0.weight")
    hostile.forge_item(ckpt, name, offset, length, hostile.torch_save_payload(marker))
    _assert_falls_back(root, weights, reason="loading failed")
    codes = _every_command(capsys, root, ckpt, tmp_path)
    assert codes["verify --checksum"] == 0 and codes["export"] == 1  # re-signed, but the payload never loads
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../__0_0.distcp", "{root}/__0_0.distcp", "sub/../../__0_0.distcp", ".."])
def test_metadata_placing_items_outside_the_checkpoint_is_refused(where, run, tmp_path, capsys):
    """A re-signed .metadata whose items lie in a file outside the checkpoint directory (there, a copy of the
    checkpoint's own shard, so every checksum matches): nothing is read from it, restore falls back."""
    import dataclasses
    import pickle

    from ckpt_core.safe_pickle import load_dcp_metadata

    root, weights = run
    ckpt = _ckpt(root, 20)
    shutil.copy(ckpt / "__0_0.distcp", root / "__0_0.distcp")
    (ckpt / "sub").mkdir()
    where = where.format(root=root)
    md = load_dcp_metadata((ckpt / ".metadata").read_bytes(), ".metadata")
    md.storage_data = {k: dataclasses.replace(v, relative_path=where) if v.relative_path == "__0_0.distcp" else v
                       for k, v in md.storage_data.items()}
    hostile.forge_file(ckpt, ".metadata", pickle.dumps(md))
    _assert_falls_back(root, weights, reason="not a file of the checkpoint directory")
    codes = _every_command(capsys, root, ckpt, tmp_path)
    assert codes["verify"] == codes["export"] == codes["inspect"] == 1


@pytest.mark.parametrize("content", [b"\x80\x04K\x01.", b"{}", b'{"prefix": "__0_", "files": {}}', b"[" * 100_000])
def test_forged_sidecar_is_refused(content, run, capsys, tmp_path):
    root, weights = run
    ckpt = _ckpt(root, 20)
    hostile.forge_file(ckpt, "__0_.ckptpart.json", content)
    _assert_falls_back(root, weights, reason="__0_.ckptpart.json")
    codes = _every_command(capsys, root, ckpt, tmp_path)
    assert codes["verify"] == codes["verify --checksum"] == codes["export"] == 1


# --------------------------------------------------- rows of the table
def test_corrupt_zip_header_falls_back_even_without_verification(run, tmp_path, capsys):
    """A shard whose zip header is damaged (same size): DCP's CheckpointException (a BaseException) means fall back."""
    root, weights = run
    ckpt = _ckpt(root, 20)
    name, offset, _ = hostile.item_of(ckpt, "model.0.weight")
    data = bytearray((ckpt / name).read_bytes())
    data[offset:offset + 4] = b"XXXX"  # the local file header signature of the item's zip
    (ckpt / name).write_bytes(bytes(data))
    info, model, _, said = _restore(root, verify="none")
    assert info.step == 10 and "loading failed" in said
    _assert_weights(model, weights[10])
    _assert_falls_back(root, weights, reason="fail their checksum")
    code, _, err = _cli(capsys, "export", str(ckpt), str(tmp_path / "w.safetensors"))
    assert code == 1 and err.count("\n") == 1 and "fail their checksum" in err


def test_synchronous_save_failure_follows_on_save_error(tmp_path, caplog):
    """async_mode='off' on a storage that fails: a SaveError, and with on_save_error='warn' training goes on."""
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"fail_after_bytes": 10}))
    url = f"faulty://{tmp_path / 'run'}"
    state, _ = _state()
    opts = {"storage_options": {"control": str(control)}, "async_mode": "off", "handle_preemption": False,
            "write_retries": 0}
    with CheckpointManager(url, on_save_error="warn", **opts) as m:
        with caplog.at_level(logging.WARNING, logger="ckpt_core"):
            assert m.save(1, state) is False
    assert "checkpoint save at step 1 failed" in caplog.text and "No space left" in caplog.text
    with CheckpointManager(url, on_save_error="raise", **opts) as m:
        with pytest.raises(SaveError, match="No space left"):
            m.save(2, state)


def test_ctrl_c_out_of_the_save_in_flight_is_not_a_failed_save(tmp_path):
    """KeyboardInterrupt or SystemExit while a save is collected stops the program even with on_save_error='warn';
    any other exception out of the writer is a SaveError."""
    from concurrent.futures import Future

    from ckpt_core.saver import InFlight, SaveStats

    def inflight(exc: BaseException) -> InFlight:
        fut: Future = Future()
        fut.set_exception(exc)
        return InFlight(step=4, future=fut, stats=SaveStats(step=4, blocking_s=0.0), t_dispatch=0.0)

    with CheckpointManager(str(tmp_path / "run"), on_save_error="warn", async_mode="thread",
                           handle_preemption=False) as m:
        saver = m._saver
        for exc, expected in ((KeyboardInterrupt(), KeyboardInterrupt), (SystemExit(3), SystemExit),
                              (RuntimeError("disk gone"), SaveError)):
            saver.inflight = inflight(exc)
            with pytest.raises(expected):
                saver.collect(block=True)
        for exc, expected in ((KeyboardInterrupt(), KeyboardInterrupt), (SystemExit(3), SystemExit)):
            saver.inflight = inflight(exc)
            with pytest.raises(expected):
                saver.finish_within(1.0)  # the flush at interpreter exit
        saver.inflight = inflight(RuntimeError("disk gone"))
        assert saver.finish_within(1.0) is True  # a failed save is reported by collect(), not at exit
        saver.inflight = None


def test_flipped_byte_in_a_rank_blob_is_detected_by_default(run):
    root, weights = run
    ckpt = _ckpt(root, 20)
    name, offset, length = hostile.item_of(ckpt, "ranks.0")
    data = bytearray((ckpt / name).read_bytes())
    data[offset + length - 100] ^= 0x01  # inside the blob: RNG state, counters, data position
    (ckpt / name).write_bytes(bytes(data))
    _assert_falls_back(root, weights, reason="fail their checksum")


def test_shard_of_another_step_is_detected(tmp_path):
    root = tmp_path / "run"
    weights = _save(root, steps=(10, 15, 20))
    a, b = _ckpt(root, 15) / "__0_0.distcp", _ckpt(root, 20) / "__0_0.distcp"
    assert a.stat().st_size == b.stat().st_size
    shutil.copy(a, b)
    said = _assert_falls_back(root, weights, bad=20, good=15, reason="fail their checksum")
    assert "__0_0.distcp" in said


def test_manifest_copied_from_another_checkpoint_is_detected(run, capsys):
    root, weights = run
    shutil.copy(_ckpt(root, 10) / "manifest.json", _ckpt(root, 20) / "manifest.json")
    info, model, state, _ = _restore(root)
    assert info.step == 10 and info.path == str(_ckpt(root, 10)) and state.step == 10
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        with pytest.raises(RestoreError, match="step_000000020.*(checksum|belongs to checkpoint|the manifest says)"):
            m.restore(_state()[0], path=str(_ckpt(root, 20)))
    assert _cli(capsys, "verify", str(_ckpt(root, 20)))[0] == 1


@pytest.mark.parametrize("raw", [{"step": "1e999"}, {"world_size": "1e999"}, {"step": "-1"}, {"step": "true"},
                                 {"world_size": "0"}, {"wall_time": "NaN"}, {"wall_time": "1e999"},
                                 {"epoch": "1.5"}, {"files": '{"../../etc/passwd": {"size": 1}}'},
                                 {"files": '{"__0_0.distcp": {"size": 1e999}}'},
                                 {"files": '{"__0_0.distcp": {"size": -5}}'},
                                 {"fingerprint": '{"model.0.weight": [1, 2]}'},
                                 {"metrics": '{"loss": "low"}'}, {"checkpoint_id": '"$(reboot)"'},
                                 {"contents": "[" * 100_000 + "]" * 100_000}])
def test_hostile_manifest_fields(raw, run, capsys):
    """Damaged manifests never crash ls, inspect, verify, prune or restore; all of them agree it is not valid."""
    root, weights = run
    hostile.set_manifest_fields(_ckpt(root, 20), raw)
    _assert_falls_back(root, weights, reason="manifest")
    code, out, _ = _cli(capsys, "ls", str(root))
    assert code == 0 and "bad-manifest" in out and "step 10" in out.splitlines()[-1]
    assert _cli(capsys, "verify", str(_ckpt(root, 20)))[0] == 1
    assert _cli(capsys, "inspect", str(_ckpt(root, 20)))[0] == 1
    code, _, _ = _cli(capsys, "prune", str(root), "--keep-last", "1", "--keep-every-seconds", "5")
    assert code == 0 and _ckpt(root, 10).exists()


def test_deeply_nested_manifest_falls_back(run, capsys):
    root, weights = run
    (_ckpt(root, 20) / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    _assert_falls_back(root, weights, reason="nested too deeply")
    assert _cli(capsys, "ls", str(root))[0] == 0


def test_directory_names_are_labels_and_ls_agrees_with_restore(run, capsys):
    """step_25 (unpadded) holding step 20 is step 20; step_٢٠ (Unicode digits) is not a checkpoint directory."""
    root, weights = run
    _ckpt(root, 20).rename(root / "step_25")
    shutil.copytree(root / "step_25", root / "step_\u0662\u0660")
    info, model, state, _ = _restore(root)
    assert (info.step, info.path, state.step) == (20, str(root / "step_25"), 20)
    _assert_weights(model, weights[20])
    code, out, _ = _cli(capsys, "ls", str(root), "--json")
    body = json.loads(out)
    assert body["newest_valid"] == 20
    assert [(c["step"], Path(c["path"]).name) for c in body["checkpoints"]] == [(10, "step_000000010"),
                                                                               (20, "step_25")]


@pytest.mark.parametrize("raw, reason", [({"world_size": "2"}, "the manifest says world size 2"),
                                         ({"epoch": "9"}, "do not belong together"),
                                         ({"step": "25"}, "files of two checkpoints are mixed")])
def test_manifest_that_disagrees_with_the_restored_state_falls_back(raw, reason, run):
    """A well-formed manifest whose step, epoch or world size is not what the checkpoint's files hold."""
    root, weights = run
    hostile.set_manifest_fields(_ckpt(root, 20), raw)
    said = _assert_falls_back(root, weights, bad=int(raw.get("step", 20)), reason=reason)
    assert "step_000000020" in said


def test_world_size_zero_agrees(run, capsys):
    root, weights = run
    hostile.set_manifest_fields(_ckpt(root, 20), {"world_size": "0"})
    _assert_falls_back(root, weights)
    body = json.loads(_cli(capsys, "ls", str(root), "--json")[1])
    assert body["newest_valid"] == 10


def test_accelerate_style_directory_names_are_listed(run, capsys):
    root, weights = run
    _ckpt(root, 20).rename(root / "checkpoint_3")
    info, model, _, _ = _restore(root)
    assert info.step == 20 and info.path.endswith("checkpoint_3")
    assert json.loads(_cli(capsys, "ls", str(root), "--json")[1])["newest_valid"] == 20


def test_explicit_path_is_accepted_whatever_its_name(run, tmp_path):
    root, weights = run
    other = tmp_path / "exported" / "best-model"
    shutil.copytree(_ckpt(root, 10), other)
    state, model = _state(seed=99)
    with CheckpointManager(str(tmp_path / "new-run"), async_mode="off", handle_preemption=False) as m:
        info = m.restore(state, path=str(other))
    assert info.step == 10 and state.step == 10
    _assert_weights(model, weights[10])
    assert _ckpt(root, 20).exists()


def _file_root(d: Path) -> str:
    (d / "afile").write_text("x")
    return str(d / "afile")


@pytest.mark.parametrize("make_root,message", [
    (_file_root, "is a regular file"),
    (lambda d: "nosuchproto://bucket/run", "cannot be opened"),
    (lambda d: "/proc/ckpt-cannot-be-created/run", "cannot be created"),
])
def test_bad_roots_fail_at_construction(make_root, message, tmp_path, capsys):
    root = make_root(tmp_path)
    with pytest.raises(CheckpointRootError, match=message) as e:
        CheckpointManager(root, every_n_steps=1, handle_preemption=False)
    assert root in str(e.value)
    code, _, err = _cli(capsys, "ls", root)
    assert code == 2 and err.count("\n") == 1


def test_a_file_root_is_refused_even_when_not_saving(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointRootError, match="afile is a regular file"):
        CheckpointManager(str(tmp_path / "afile"), handle_preemption=False)
