"""Direct reads: on a local file system a restore reads the large regions of a checkpoint with ``O_DIRECT``.

Each reading thread reads whole blocks into a page-aligned buffer of its own,
checks them there (CRC32C) and copies the bytes into the load target; the
checkpoint's pages never enter the page cache. These tests restore real
checkpoints both ways and compare the tensors bit for bit, look at the page
cache with ``mincore``, and damage bytes inside a directly read region.
"""

from __future__ import annotations

import ctypes
import json
import errno
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hostile
from ckpt_core import TrainState, inplace_read
from ckpt_core.dcp_io import DATA_SUFFIX
from helpers_ckpt import flip_byte, restore_warned, save_distinct, sharded_model_factory, step_path

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(path: str) -> int:
    """Bytes of file ``path`` in the page cache (``mincore`` over a read-only shared mapping of it)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            assert _LIBC.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec) * mmap.PAGESIZE
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)


def evict(ckpt: str) -> list[str]:
    """Drop the data files of checkpoint ``ckpt`` from the page cache; their paths."""
    files = sorted(str(p) for p in Path(ckpt).iterdir() if p.name.endswith(DATA_SUFFIX))
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return files


def direct_io_works(directory: Path) -> bool:
    """Whether the file system of ``directory`` serves ``O_DIRECT`` reads."""
    probe = directory / "o_direct_probe"
    probe.write_bytes(b"\0" * 8192)
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    finally:
        probe.unlink()
    os.close(fd)
    return True


class Odd(nn.Module):
    """Tensors whose sizes are not multiples of a block, in several dtypes, so items start at odd offsets."""

    def __init__(self, scale: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(scale * 1000 + 3, generator=g))
        self.b = nn.Parameter(torch.randn(scale * 200 + 1, 5, generator=g).to(torch.bfloat16))
        self.c = nn.Parameter(torch.randn(scale * 700 + 11, generator=g, dtype=torch.float64))
        self.register_buffer("d", torch.randint(-2**40, 2**40, (scale * 300 + 7,), generator=g))
        self.e = nn.Parameter(torch.randn(3, generator=g))


def _restore(root: Path, direct: bool, scale: int = 1, **settings: Any) -> tuple[Odd, int, str]:
    """A fresh model restored from the newest usable checkpoint under ``root``: (model, its step, warnings)."""
    fresh = Odd(scale, seed=99)
    info, said = restore_warned(root, TrainState(model=fresh), direct_io=direct, **settings)
    return fresh, info.step, said.replace(_SINGLE_PROCESS, "")


_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load " \
                  "in a single process."


@pytest.fixture
def small_direct(monkeypatch):
    """Direct reads of 8 KiB chunks for regions from 4 KiB, ends of 4 KiB, no item read whole: the direct
    path's first, middle and last blocks on tensors of a few KiB."""
    monkeypatch.setattr(inplace_read, "DIRECT_MIN", 4096)
    monkeypatch.setattr(inplace_read, "DIRECT_CHUNK", 8192)
    monkeypatch.setattr(inplace_read, "ENVELOPE", 4096)
    monkeypatch.setattr(inplace_read, "WHOLE_ITEM", 0)


def test_direct_reads_restore_every_tensor_bit_exact(tmp_path, small_direct, monkeypatch):
    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the test directory refuses O_DIRECT")
    root = tmp_path / "run"
    model = Odd(scale=4)
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    reads: list[int] = []
    real = inplace_read._read_direct

    def counted(source, offset, dest, digest, stop):
        reads.append(len(dest))
        return real(source, offset, dest, digest, stop)

    monkeypatch.setattr(inplace_read, "_read_direct", counted)
    evict(step_path(root, 20))
    restored, step, said = _restore(root, direct=True, scale=4)
    assert (step, said) == (20, "")
    regions = [t.numel() * t.element_size() for t in (model.a, model.b, model.c, model.d)]
    assert min(regions) >= 4096 and sorted(regions) == sorted(r for r in reads if r in regions)
    for name, value in weights[20].items():
        assert torch.equal(restored.state_dict()[name], value), name
        assert restored.state_dict()[name].dtype == value.dtype


def test_a_restore_reads_large_tensors_without_filling_the_page_cache(tmp_path):
    """At the real sizes (regions of 1 MiB and more, 4 MiB reads): with direct reads the data files stay out
    of the page cache but for each item's two ends (64 KiB each, read buffered, and the kernel's read-ahead
    around them: about 1 MB of 34 MB here); without, they are read into it. Both restore the same tensors."""
    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the test directory refuses O_DIRECT")
    root = tmp_path / "run"
    model = Odd(scale=2400)  # a: 9.6 MB, b: 4.8 MB, c: 13.4 MB, d: 5.8 MB
    weights = save_distinct(root, TrainState(model=model), model, (10,))
    ckpt = step_path(root, 10)
    for direct in (True, False):
        files = evict(ckpt)
        size = sum(os.path.getsize(p) for p in files)
        restored, step, said = _restore(root, direct=direct, scale=2400)
        cached = sum(resident_bytes(p) for p in files)
        assert (step, said) == (10, "")
        assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())
        if direct:
            assert cached <= 0.05 * size, (cached, size)
        else:
            assert cached >= 0.9 * size, (cached, size)


@pytest.fixture
def two_saves(tmp_path, small_direct):
    """Checkpoints at steps 10 and 20 of an ``Odd(4)`` under ``tmp_path / "run"``: (root, weights by step,
    (file, offset, length) of step 20's item of ``model.c``)."""
    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the test directory refuses O_DIRECT")
    root = tmp_path / "run"
    model = Odd(scale=4)
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    return root, weights, hostile.item_of(Path(step_path(root, 20)), "model.c")


def test_a_damaged_byte_inside_a_directly_read_region_falls_back_naming_the_file(two_saves):
    root, weights, (name, offset, length) = two_saves
    flip_byte(step_path(root, 20), name, offset + length // 2)  # far from both ends: read directly
    restored, step, said = _restore(root, direct=True, scale=4)
    assert step == 10 and "step 20" in said and name in said
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())


@pytest.mark.parametrize("cut", [0, 1, 4096, 5000])
def test_a_data_file_ending_inside_a_directly_read_region_falls_back(two_saves, cut):
    """A data file cut inside an item's storage (at a block boundary or not, ``cut`` bytes past its middle):
    the direct read meets the end of the file, the restore falls back to the older checkpoint."""
    root, weights, (name, offset, length) = two_saves
    os.truncate(os.path.join(step_path(root, 20), name), (offset + length // 2) // 4096 * 4096 + cut)
    restored, step, said = _restore(root, direct=True, scale=4)
    assert step == 10 and "step 20" in said
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())


def test_a_file_system_refusing_a_direct_read_is_read_buffered_from_there(tmp_path, small_direct, monkeypatch):
    """``EINVAL`` from a direct read (a file system that opens with ``O_DIRECT`` but does not serve it):
    that file's reads go on buffered, and the restore is exact."""
    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the test directory refuses O_DIRECT")
    root = tmp_path / "run"
    model = Odd(scale=4)
    weights = save_distinct(root, TrainState(model=model), model, (10,))
    calls = []
    real = os.preadv

    def refusing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 2:  # the second direct read, in the middle of a region
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(inplace_read.os, "preadv", refusing)
    restored, step, said = _restore(root, direct=True, scale=4)
    assert (step, said) == (10, "") and len(calls) >= 2
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())


def test_direct_io_off_reads_through_the_page_cache(tmp_path, small_direct, monkeypatch):
    root = tmp_path / "run"
    model = Odd(scale=4)
    weights = save_distinct(root, TrainState(model=model), model, (10,))
    monkeypatch.setattr(inplace_read, "_read_direct", lambda *a: pytest.fail("a direct read with direct_io off"))
    restored, step, said = _restore(root, direct=False, scale=4)
    assert (step, said) == (10, "")
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())


def _items(sizes: list[int]) -> dict[str, list]:
    files: dict[str, list] = {}
    offset = 0
    for i, n in enumerate(sizes):
        files.setdefault(f"__0_{i % 4}.distcp", []).append(inplace_read._Item(f"__0_{i % 4}.distcp", offset, n, []))
        offset += n
    return files


def test_parts_of_equal_items_are_equal():
    """16 items of 64 MiB and a few headers' bytes in 4 files and a rank's small state of 10 kB in the
    first, 8 threads: every part holds two of the large items (the slowest part sets the load's time; cut
    at 'at least the size', the first file's parts were 3 items and 1 with the small one)."""
    item = (64 << 20) + 1133
    files = _items([item] * 16)
    files["__0_0.distcp"].append(inplace_read._Item("__0_0.distcp", 16 * item, 10_000, []))
    parts = inplace_read._parts(files)
    assert [[it.length for it in items] for _, items in parts] == [[item] * 2] * 2 + [[10_000]] + [[item] * 2] * 6


@pytest.mark.parametrize("sizes,expected", [
    ([100 << 20, 30 << 20, 30 << 20, 100 << 20], [1, 1, 1, 1]),  # 260 MiB over 8 threads: PART_MIN (64 MiB) each
    ([10 << 20] * 8, [2, 2, 2, 2]),  # 80 MiB: parts of at least PART_MIN, each file's two items together
])
def test_parts_keep_each_file_in_runs_near_the_part_size(sizes, expected):
    parts = inplace_read._parts(_items(sizes))
    assert [len(items) for _, items in parts] == expected
    assert sorted(it.offset for _, items in parts for it in items) == sorted(
        it.offset for items in _items(sizes).values() for it in items)


def _sharded_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    """Save a model of DTensor shards of 1.5 MiB (one uneven), restore it into a fresh one: the facts (the
bytes read by ``_read_direct``, and of those, by ``_read_straight`` with no copy)."""
    import torch.distributed as dist

    from ckpt_core import CheckpointManager

    model = sharded_model_factory(rank, world, port, 1024, 1536, 1_500_007)
    saved = model(0)
    from ckpt_core import dcp_io

    dcp_io.ALIGN_OVERHEAD = 0.05  # two items of 1.5 MiB: 64 KiB of padding is 2 % of them
    with CheckpointManager(root, async_mode="off", handle_preemption=False) as m:
        m.save(5, TrainState(model=saved))
    facts = {"step": {}, "direct_reads": {}, "straight": {}, "into_live": {}, "exact": {},
             "shards": [p.to_local().numel() * 4 for p in (saved.w, saved.v)]}
    real, real_straight = inplace_read._read_direct, inplace_read._read_straight
    for in_place in (False, True):
        reads: list[int] = []
        straight: list[int] = []
        into: list[int] = []  # where each direct read puts its bytes
        inplace_read._read_direct = lambda source, offset, dest, *a: (reads.append(len(dest)),
                                                                       into.append(inplace_read._address(dest)),
                                                                       real(source, offset, dest, *a))[2]
        inplace_read._read_straight = lambda source, offset, dest, *a: (straight.append(len(dest)),
                                                                         real_straight(source, offset, dest, *a))[1]
        fresh = model(1)
        live = [(p.to_local().data_ptr(), p.to_local().data_ptr() + p.to_local().nbytes) for p in fresh.parameters()]
        try:
            with CheckpointManager(root, async_mode="off", handle_preemption=False, restore_in_place=in_place) as m:
                info = m.restore(TrainState(model=fresh))
        finally:
            inplace_read._read_direct, inplace_read._read_straight = real, real_straight
        mode = "in_place" if in_place else "fresh"
        facts["step"][mode], facts["direct_reads"][mode], facts["straight"][mode] = info.step, sorted(reads), \
            sum(straight)
        facts["into_live"][mode] = [any(a <= at and at + n <= b for a, b in live) for at, n in zip(into, reads)]
        facts["exact"][mode] = all(torch.equal(a.to_local(), b.to_local())
                                   for a, b in zip(saved.parameters(), fresh.parameters()))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


def test_every_rank_of_4_reads_its_shards_directly_and_restores_them_exactly(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the test directory refuses O_DIRECT")
    mp.spawn(_sharded_worker, args=(4, free_port(), str(tmp_path / "run"), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mode in ("fresh", "in_place"):
            assert facts["step"][mode] == 5 and facts["exact"][mode], (rank, mode, facts)
            shards, reads = facts["shards"], facts["direct_reads"][mode]
            assert sorted(shards) == [r for r in reads if r in shards], (rank, mode, facts)
        # aligned files read into aligned fresh local shards: all but each shard's last partial block without a copy
        assert facts["straight"]["fresh"] >= sum(facts["shards"]) - 2 * 4096, (rank, facts)
        # in place, every direct read lands in the live shards themselves (through the aligned buffer unless a
        # shard happens to lie on a block boundary); otherwise in fresh buffers, never in the live shards
        assert facts["into_live"]["in_place"] and all(facts["into_live"]["in_place"]), (rank, facts)
        assert facts["into_live"]["fresh"] and not any(facts["into_live"]["fresh"]), (rank, facts)
    assert json.loads((tmp_path / "rank3.json").read_text())["shards"][1] == (1_500_007 - 3 * 375_002) * 4
