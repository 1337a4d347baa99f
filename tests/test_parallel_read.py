"""The read path of a restore: files read side by side, every item read once and checked whole.

``ckpt_core.inplace_read`` reads the files of a checkpoint on a thread pool,
each item front to back with the load target's region straight into the
target and a CRC32C over every read; these tests make the reads small
(``READ_CHUNK``, ``ENVELOPE``, ``WHOLE_ITEM``) so that items of a few KiB go
through the chunked reads, the two ends in memory and the scratch buffer.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import hostile
from ckpt_core import TrainState, inplace_read
from ckpt_core.dcp_io import make_reader
from ckpt_core.discovery import read_manifest
from ckpt_core.integrity import IntegrityError
from ckpt_core.storage import get_fs
from helpers_ckpt import restore_warned, save_distinct, step_path


@pytest.fixture
def small_reads(monkeypatch):
    """Reads of 1 KiB, 4 KiB ends and no item read whole but the smallest: every path of ``_fill`` on small
    tensors (weights of 13.8 KiB are large items, biases small ones)."""
    monkeypatch.setattr(inplace_read, "READ_CHUNK", 1024)
    monkeypatch.setattr(inplace_read, "ENVELOPE", 4096)
    monkeypatch.setattr(inplace_read, "WHOLE_ITEM", 0)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 48) for _ in range(8)])  # 16 items over 4 files (4 writer threads)


def _flip(path: str, name: str, at: int) -> None:
    fs, p = get_fs(path)
    data = bytearray(fs.cat_file(f"{p}/{name}"))
    data[at] ^= 0x01
    fs.pipe_file(f"{p}/{name}", bytes(data))


def test_files_are_read_in_parallel_and_a_corrupt_item_in_one_falls_back_naming_it(tmp_path, small_reads,
                                                                                     monkeypatch):
    root = tmp_path / "run"
    model = _model()
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    ckpt = step_path(root, 20)
    items = [hostile.item_of(ckpt, f"model.{i}.weight") for i in range(8)]
    name, offset, length = next(item for item in items if item[0] != "__0_0.distcp")  # not the file read first
    _flip(ckpt, name, offset + length // 2)

    meeting = threading.Barrier(2)
    threads: set[str] = set()
    calls = []
    real = inplace_read._read_file

    def spy(*args, **kwargs):
        threads.add(threading.current_thread().name)
        calls.append(1)
        if len(calls) <= 2:
            try:
                meeting.wait(timeout=30)  # the first two files are being read at the same time
            except threading.BrokenBarrierError:
                pass
        return real(*args, **kwargs)

    monkeypatch.setattr(inplace_read, "_read_file", spy)
    fresh = _model(seed=99)
    info, said = restore_warned(root, TrainState(model=fresh))
    assert info.step == 10
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[10][k]), k
    assert "step 20" in said and "not usable" in said and name in said and "fail their checksum" in said, said
    assert len(threads) >= 2 and not meeting.broken


def test_restore_reads_in_place_through_every_path_of_the_pass(tmp_path, small_reads, monkeypatch):
    root = tmp_path / "run"
    model = _model()
    weights = save_distinct(root, TrainState(model=model), model, (10,))
    paths: list[str] = []
    for name in ("_read_whole", "_read_large"):
        real = getattr(inplace_read, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            ok = _real(*args, **kwargs)
            paths.append(_name if ok else "DCP")
            return ok

        monkeypatch.setattr(inplace_read, name, spy)
    fresh = _model(seed=99)
    info, said = restore_warned(root, TrainState(model=fresh))
    assert info.step == 10 and "not usable" not in said, said
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[10][k]), k
    assert paths.count("_read_large") >= 8 and paths.count("_read_whole") >= 8 and "DCP" not in paths, paths


def _region_load(ckpt: str, fqn: str, rows: tuple[int, int]) -> tuple[torch.Tensor, list]:
    """Rows ``rows`` of the saved 2-D tensor ``fqn``, read by ``read_in_place`` through a verifying reader."""
    fs, p = get_fs(ckpt)
    reader = make_reader(ckpt, manifest=read_manifest(fs, p))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    cols = metadata.state_dict_metadata[fqn].size[1]
    target = torch.empty(rows[1] - rows[0], cols)
    req = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, (0, 0)), dest_offsets=torch.Size((0, 0)),
                   storage_index=index, storage_offsets=torch.Size((rows[0], 0)), lengths=torch.Size(target.shape))
    committed: list = []
    planner = SimpleNamespace(resolve_tensor=lambda r: target, commit_tensor=lambda r, t: committed.append(r))
    rest = inplace_read.read_in_place(reader, LoadPlan([req]), planner)
    assert rest.items == []
    return target, committed


def test_a_region_is_read_into_its_target_and_the_whole_item_is_checked(tmp_path, small_reads):
    root = tmp_path / "run"
    model = _model()
    weights = save_distinct(root, TrainState(model=model), model, (10,))
    ckpt = step_path(root, 10)
    target, committed = _region_load(ckpt, "model.2.weight", (5, 20))
    assert torch.equal(target, weights[10]["2.weight"][5:20]) and len(committed) == 1

    name, offset, length = hostile.item_of(ckpt, "model.2.weight")
    _flip(ckpt, name, offset + length - 2000)  # in the last rows: bytes the region does not take
    with pytest.raises(IntegrityError, match=rf"{name} bytes {offset}\.\.{offset + length} fail their checksum"):
        _region_load(ckpt, "model.2.weight", (5, 20))


def test_the_first_error_in_file_order_is_raised_and_the_other_files_stop():
    stop = threading.Event()

    def job(i: int) -> int:
        if i == 1:
            time.sleep(0.05)
            raise ValueError("file 1 is corrupt")
        if i == 0:
            return 0
        if not stop.wait(timeout=20):
            return i
        raise inplace_read._Stopped()

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="file 1 is corrupt"):
        inplace_read._run_all(job, [0, 1, 2, 3], stop)
    assert time.monotonic() - t0 < 10


def test_an_items_pickle_is_read_only_once_the_item_matched_its_checksum(tmp_path, small_reads, monkeypatch):
    """The pickle of an item (``torch.load`` on the meta device) is read only after its CRC32C matched, also
    for a large item whose storage bytes were placed from its zip header; a damaged pickle is never read."""
    root = tmp_path / "run"
    model = _model()
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    ckpt = step_path(root, 20)
    name, offset, _ = hostile.item_of(ckpt, "model.3.weight")
    _flip(ckpt, name, offset + 100)  # inside the archive's data.pkl

    events: dict[int, list[str]] = {}
    real_check, real_layout = inplace_read._Digest.check, inplace_read._layout

    def check(self, item):
        events.setdefault(threading.get_ident(), []).append("check")
        real_check(self, item)
        events[threading.get_ident()].append("ok")

    def layout(view):
        events.setdefault(threading.get_ident(), []).append("parse")
        return real_layout(view)

    monkeypatch.setattr(inplace_read._Digest, "check", check)
    monkeypatch.setattr(inplace_read, "_layout", layout)
    fresh = _model(seed=99)
    info, said = restore_warned(root, TrainState(model=fresh))
    assert info.step == 10 and name in said and "fail their checksum" in said, said
    assert torch.equal(fresh.state_dict()["3.weight"], weights[10]["3.weight"])
    seen = [e for per_thread in events.values() for e in per_thread]
    assert seen.count("parse") > 0
    for per_thread in events.values():
        for i, event in enumerate(per_thread):
            assert event != "parse" or (i > 0 and per_thread[i - 1] == "ok"), per_thread


def test_a_failed_attempt_keeps_none_of_its_buffers_once_the_restore_fell_back(tmp_path, small_reads,
                                                                                monkeypatch):
    """Loading into fresh buffers (``restore_in_place=False``), the failed load's buffers (a whole copy of the
    state) are freed by reference counting when the restore falls back: no reference cycle through the failed
    read's frames keeps them until a garbage collection."""
    import gc
    import weakref

    root = tmp_path / "run"
    model = _model()
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    ckpt = step_path(root, 20)
    name, offset, length = hostile.item_of(ckpt, "model.5.weight")
    _flip(ckpt, name, offset + length // 2)
    buffers: list[list] = []
    real = TrainState.load_template

    def recording(self, *args, **kwargs):
        template, wanted = real(self, *args, **kwargs)
        buffers.append([weakref.ref(t) for t in template["model"].values() if isinstance(t, torch.Tensor)])
        return template, wanted

    monkeypatch.setattr(TrainState, "load_template", recording)
    fresh = _model(seed=99)
    gc.disable()
    try:
        info, said = restore_warned(root, TrainState(model=fresh), restore_in_place=False)
        assert info.step == 10 and "fail their checksum" in said
        assert len(buffers) == 2 and len(buffers[0]) == 16
        assert [r for r in buffers[0] if r() is not None] == []
    finally:
        gc.enable()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[10][k]), k
