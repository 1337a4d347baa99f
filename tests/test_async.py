"""Asynchronous saves: same bytes as sync, staging reuse, failures surfaced, kills never commit torn data."""

from __future__ import annotations

import gc
import json
import logging
import struct
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt_core.faults  # noqa: F401  (registers faulty://)
from ckpt_core import CheckpointManager, SaveError, TrainState, dcp_io
from ckpt_core.discovery import list_records, read_manifest, validate
from ckpt_core.storage import get_fs
from conftest import WORKERS, run_script


def _state(seed: int = 0, width: int = 64) -> tuple[nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.1), nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt, TrainState(model=model, optimizers=opt)


def _restored(root: Path):
    model, opt, state = _state(seed=123)
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        assert m.restore(state).step == 5
    return model, opt


@pytest.mark.parametrize("mode", ["thread", "bytes"])
def test_async_and_sync_saves_restore_identical_tensors(tmp_path, mode):
    model, opt, state = _state()
    for name, m_mode in (("sync", "off"), ("async", mode)):
        with CheckpointManager(str(tmp_path / name), async_mode=m_mode, handle_preemption=False) as m:
            m.save(5, state)
    a_model, a_opt = _restored(tmp_path / "sync")
    b_model, b_opt = _restored(tmp_path / "async")
    for k, v in model.state_dict().items():
        assert torch.equal(a_model.state_dict()[k], v) and torch.equal(b_model.state_dict()[k], v)
    for (pa, sa), (pb, sb) in zip(a_opt.state.items(), b_opt.state.items()):
        for key in sa:
            assert torch.equal(sa[key], sb[key])
    ma = read_manifest(get_fs(str(tmp_path))[0], str(tmp_path / "sync" / "step_000000005"))
    mb = read_manifest(get_fs(str(tmp_path))[0], str(tmp_path / "async" / "step_000000005"))
    assert ma.fingerprint == mb.fingerprint


def _central_crcs(buf: bytes) -> list[int]:
    out, i = [], buf.find(b"PK\x01\x02")
    while i != -1:
        out.append(struct.unpack_from("<I", buf, i + 16)[0])
        i = buf.find(b"PK\x01\x02", i + 4)
    return out


def _zip_crcs(path: Path) -> list[int]:
    """CRC32 fields of the zip central-directory entries in DCP's data files (one zip per tensor)."""
    return [c for f in sorted(path.glob("*.distcp")) for c in _central_crcs(f.read_bytes())]


def _zip_crcs_of_blob(state: TrainState) -> list[int]:
    """The zip entries inside the per-rank blob (a byte tensor that torch.save built on the training side)."""
    from ckpt_core.state import RANK_KEY

    return [c for v in state.state_dict()[RANK_KEY].values() for c in _central_crcs(v.numpy().tobytes())]


def test_zip_crc32_is_skipped_in_the_writer_threads_only(tmp_path):
    """DCP's torch.save zips skip their CRC32 (CRC32C covers the files) in every mode; other threads keep it."""
    import io
    import threading

    from torch.utils.serialization import config

    model, opt, state = _state()
    blob = _zip_crcs_of_blob(state)  # built by torch.save on this thread: has its CRCs
    assert blob and 0 not in blob
    user_crcs = []

    def user_saves() -> None:  # a user's torch.save on another thread while the background write runs
        for _ in range(50):
            buf = io.BytesIO()
            torch.save(torch.arange(8.0), buf)
            user_crcs.extend(_central_crcs(buf.getvalue()))

    for mode in ("off", "thread", "process", "bytes"):
        with CheckpointManager(str(tmp_path / mode), async_mode=mode, handle_preemption=False) as m:
            m.save(5, state)
            t = threading.Thread(target=user_saves)
            t.start()
            t.join()
            assert config.save.compute_crc32 is True
        crcs = _zip_crcs(tmp_path / mode / "step_000000005")
        if dcp_io._CONFIG_PATCHES_ARE_CONTEXT_LOCAL:
            # every zip entry DCP wrote has CRC 0, except those inside the per-rank blob (a byte tensor)
            assert crcs.count(0) == len(crcs) - len(blob) > 0, mode
        else:  # torch < 2.12: a patch would be process-wide, so the CRC is kept
            assert crcs and 0 not in crcs, mode
        a_model, _ = _restored(tmp_path / mode)
        for k, v in model.state_dict().items():
            assert torch.equal(a_model.state_dict()[k], v)
    assert user_crcs and 0 not in user_crcs


def test_staging_buffers_are_reused(tmp_path):
    model, opt, state = _state(width=128)
    with CheckpointManager(str(tmp_path), async_mode="thread", handle_preemption=False) as m:
        m.save(1, state)
        m.wait()
        cache = m._saver.stager._state_dict_stager._cached_storage_mapping
        first = {id(v): v.data_ptr() for v in cache.values()}
        assert len(first) >= 4
        with torch.no_grad():
            model[0].weight.add_(1.0)
        m.save(2, state)
        m.wait()
        second = {id(v): v.data_ptr() for v in cache.values()}
    assert second == first  # no new host buffer: the same storages were refilled
    model2, _, state2 = _state(seed=7, width=128)
    with CheckpointManager(str(tmp_path), async_mode="off", handle_preemption=False) as m:
        m.restore(state2)
    assert torch.equal(model2[0].weight, model[0].weight)  # and the refilled copy was written


def _stream_classes() -> int:
    """Classes alive named like DCP's per-item stream wrapper (``NoCloseWriter``)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, type) and o.__name__ == "NoCloseWriter")


def test_a_save_defines_no_class_per_tensor(tmp_path):
    """DCP wraps each item's stream in a class it defines anew per item (garbage for the collector per
    tensor and save); the commit writers wrap every item in one class, and the bytes restore exactly."""
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(16)) for _ in range(200)])
    gc.collect()
    gc.disable()
    try:
        before = _stream_classes()
        with CheckpointManager(str(tmp_path), async_mode="off", handle_preemption=False) as m:
            m.save(1, TrainState(model=model))
        created = _stream_classes() - before
    finally:
        gc.enable()
    assert created == 0
    fresh = nn.ParameterList([nn.Parameter(torch.zeros(16)) for _ in range(200)])
    with CheckpointManager(str(tmp_path), async_mode="off", handle_preemption=False) as m:
        m.restore(TrainState(model=fresh))
    assert all(torch.equal(a, b) for a, b in zip(fresh, model))


def test_checksums_computed_while_writing_match_the_files(tmp_path):
    _, _, state = _state()
    with CheckpointManager(str(tmp_path), async_mode="thread", handle_preemption=False) as m:
        m.save(3, state)
    path = str(tmp_path / "step_000000003")
    manifest = read_manifest(get_fs(path)[0], path)
    assert validate(path, manifest, "checksum") is None
    assert {".metadata", "__0_0.distcp", "__0_.ckptpart.json"} <= set(manifest.files)


def test_background_failure_is_reported_then_warn_continues(tmp_path, caplog):
    control = tmp_path / "control.json"
    control.write_text("{}")
    root = f"faulty://{tmp_path / 'ckpt'}"
    model, opt, state = _state()
    m = CheckpointManager(root, async_mode="thread", on_save_error="warn", handle_preemption=False,
                          storage_options={"control": str(control)}, every_n_steps=10)
    m.save(10, state)
    m.wait()
    control.write_text(json.dumps({"fail_after_bytes": 2000}))
    m.save(20, state)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        m.wait()
    assert any("checkpoint save at step 20 failed" in r.getMessage() and "No space left on device" in r.getMessage()
               for r in caplog.records)
    control.write_text("{}")
    m.save(30, state)
    m.close()
    recs = {r.step: r.committed for r in list_records(root, {"control": str(control)})}
    assert recs == {10: True, 30: True}  # the torn step 20 was cleaned once 30 committed


def test_background_failure_raises_on_training_side(tmp_path):
    control = tmp_path / "control.json"
    control.write_text(json.dumps({}))
    root = f"faulty://{tmp_path / 'ckpt'}"
    _, _, state = _state()
    m = CheckpointManager(root, async_mode="thread", handle_preemption=False, every_n_steps=1,
                          storage_options={"control": str(control)})
    m.save(1, state)
    m.wait()
    control.write_text(json.dumps({"fail_after_bytes": 100}))
    m.save(2, state)
    deadline = time.monotonic() + 30
    with pytest.raises(SaveError, match=r"save at step 2 failed: .*No space left on device") as err:
        while time.monotonic() < deadline:
            m.maybe_save(2, state)  # polls; step 2 is not due again
            time.sleep(0.05)
    assert err.value.step == 2
    control.write_text("{}")
    m.close()
    assert [r.step for r in list_records(root, {"control": str(control)}) if r.committed] == [1]


def test_transient_errors_are_retried_and_the_checkpoint_commits(tmp_path, caplog):
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"fail_first_writes": 2}))
    root = f"faulty://{tmp_path / 'ckpt'}"
    model, _, state = _state()
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        # one writer thread: the failures hit one attempt after the other (with more, one attempt can take both)
        with CheckpointManager(root, async_mode="thread", handle_preemption=False, retry_backoff_s=0.01,
                               writer_threads=1, storage_options={"control": str(control)}) as m:
            m.save(4, state)
    msgs = [r.getMessage() for r in caplog.records]
    # each new connection fails twice: the shard writes and the manifest write are both retried
    assert sum("writing the shards" in x and "retry" in x for x in msgs) == 2
    assert sum("writing manifest.json" in x and "retry" in x for x in msgs) == 2
    assert [r.step for r in list_records(root, {"control": str(control)}) if r.committed] == [4]


def test_in_flight_policy_skip_and_wait(tmp_path, caplog):
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"delay_per_file_s": 0.5}))
    root = f"faulty://{tmp_path / 'ckpt'}"
    _, _, state = _state()
    opts = {"control": str(control)}
    with caplog.at_level(logging.INFO, logger="ckpt_core"):
        with CheckpointManager(root, async_mode="thread", on_in_flight="skip", handle_preemption=False,
                               storage_options=opts) as m:
            assert m.save(1, state) is True
            assert m.save(2, state) is False  # still writing step 1: skipped
        with CheckpointManager(root, async_mode="thread", handle_preemption=False, storage_options=opts) as m:
            assert m.save(3, state) is True
            assert m.save(4, state) is True  # waited for step 3
    msgs = [r.getMessage() for r in caplog.records]
    assert any("skipping the save at step 2: the save at step 1 is still writing" in x for x in msgs)
    assert any("save at step 4 waits for the save at step 3" in x for x in msgs)
    assert [r.step for r in list_records(root, opts) if r.committed] == [1, 3, 4]


def test_host_memory_bound_falls_back_to_synchronous(tmp_path, caplog):
    _, _, state = _state(width=128)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        with CheckpointManager(str(tmp_path), async_mode="thread", max_host_memory_bytes=10_000,
                               handle_preemption=False) as m:
            m.save(1, state)
            assert m._saver.inflight is None  # already durable when save() returned
            assert len(m._saver.stager._state_dict_stager._cached_storage_mapping) == 0  # nothing staged
    assert any("exceeds max_host_memory_bytes=10000" in r.getMessage() for r in caplog.records)


def _kill_during_write(tmp_path, kill_group: bool):
    root, control = tmp_path / "ckpt", tmp_path / "control.json"
    args = ["--root", f"faulty://{root}", "--control", str(control), "--scenario", "kill"]
    proc = run_script(WORKERS / "async_worker.py", args + (["--kill-group"] if kill_group else []),
                      check=False, new_session=True)
    assert "killing during the background write" in proc.stdout and proc.returncode == -9
    return root


def _restore_big(root):
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        return m.restore(TrainState(model=model)).step


def test_node_failure_during_background_write_leaves_it_uncommitted(tmp_path):
    """Trainer and its checkpoint process die together: the half-written step is never committed."""
    root = _kill_during_write(tmp_path, kill_group=True)
    recs = {r.step: r for r in list_records(str(root))}
    assert recs[10].committed and not recs[20].committed
    assert recs[20].problem == "no manifest.json (in progress or torn)"
    assert _restore_big(root) == 10


def test_trainer_killed_during_background_write_commits_only_complete_data(tmp_path):
    """Only the trainer dies: the orphaned writer may finish; whatever is committed verifies by checksum."""
    root = _kill_during_write(tmp_path, kill_group=False)
    committed = [r for r in list_records(str(root)) if r.committed]
    assert [r.step for r in committed][0] == 10
    for r in committed:
        assert validate(r.path, read_manifest(get_fs(r.path)[0], r.path), "checksum") is None
    assert _restore_big(root) == committed[-1].step


@pytest.mark.parametrize("policy,rc", [("raise", 3), ("warn", 0)])
def test_disk_full_in_background_process(tmp_path, policy, rc):
    root, control = tmp_path / "ckpt", tmp_path / "control.json"
    proc = run_script(WORKERS / "async_worker.py", ["--root", f"faulty://{root}", "--control", str(control),
                                                    "--scenario", "diskfull", "--on-save-error", policy],
                      expect_rc=rc)
    committed = [r.step for r in list_records(str(root)) if r.committed]
    if policy == "raise":
        assert "SAVE ERROR step=20" in proc.stdout and "No space left on device" in proc.stdout
        assert committed == [10]
    else:
        assert "checkpoint save at step 20 failed" in proc.stderr and "committed 30" in proc.stdout
        assert committed == [10, 30]


def test_poll_commits_and_runs_retention_without_blocking(tmp_path):
    """A loop that drives save() itself calls poll() each step: the commit and retention happen in the background."""
    model, opt, state = _state()
    with CheckpointManager(str(tmp_path), async_mode="thread", keep_last=1, handle_preemption=False) as m:
        m.save(1, state)
        m.wait()
        m.save(2, state)
        deadline = time.monotonic() + 60
        while (tmp_path / "step_000000001").exists() and time.monotonic() < deadline:
            m.poll()  # never blocks; a finished save is committed, then retention deletes step 1
            time.sleep(0.01)
        assert not (tmp_path / "step_000000001").exists()
        assert [s.step for s in m.save_history if s.committed] == [1, 2]
    assert [r.step for r in list_records(str(tmp_path))] == [2]
