"""The recovery benchmark's reference reads (benchmarks/recovery.py ``cold_reads``): every byte of every file
is read by each of the three reads, and the direct read into fresh buffers lands each file's bytes in a buffer
of its own at the right offsets, odd sizes and files over one read chunk included."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from benchmarks.recovery import _direct_read, _fresh_threads, _resident, cold_read, cold_reads
from test_direct_read import direct_io_works

SIZES = {"a.distcp": 3 * 4096 + 17, "b.distcp": 1, "c.distcp": 2 * 4096, ".metadata": 700}


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    for i, (name, size) in enumerate(SIZES.items()):
        (tmp_path / name).write_bytes(bytes((i * 31 + j) % 251 for j in range(size)))
    return tmp_path


def test_the_three_reads_cover_every_byte_and_the_limit_is_the_faster_of_buffered_and_direct(checkpoint):
    total, buffered, direct, fresh = cold_reads(str(checkpoint), chunk=4096)
    assert total == sum(SIZES.values())
    assert buffered > 0
    if not direct_io_works(checkpoint):
        assert (direct, fresh) == (None, None)
        return
    assert direct > 0 and fresh > 0
    read_bytes, best, kinds = cold_read(str(checkpoint), chunk=4096)
    assert read_bytes == total and set(kinds) == {"buffered_s", "direct_s", "fresh_s"}
    assert best == min(kinds["buffered_s"], kinds["direct_s"])


@pytest.mark.parametrize("threads", [1, 3])
def test_the_fresh_read_puts_each_file_in_a_page_aligned_buffer_of_its_own(checkpoint, threads):
    if not direct_io_works(checkpoint):
        pytest.skip("the file system of the temporary directory refuses O_DIRECT")
    names = [str(checkpoint / n) for n in sorted(SIZES)]
    buffers: list[mmap.mmap] = []

    def fresh(size: int) -> mmap.mmap:
        buffers.append(mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE))
        return buffers[-1]

    assert _direct_read(str(checkpoint), names, fresh, chunk=4096, threads=threads) is not None
    try:
        assert sorted(len(b) for b in buffers) == sorted(-(-os.path.getsize(n) // 4096) * 4096 for n in names)
        contents = sorted(bytes(b) for b in buffers)
        for name in names:
            data = Path(name).read_bytes()
            padded = data + bytes(-len(data) % 4096)
            assert padded in contents, name
    finally:
        for b in buffers:
            b.close()


def test_the_fresh_read_runs_a_thread_per_file_beside_resident_memory_of_the_checkpoints_size():
    assert _fresh_threads(["a"]) == 1 and _fresh_threads(["a"] * 4) == 4 and _fresh_threads(["a"] * 20) == 8
    live = _resident(3 * mmap.PAGESIZE + 5)
    try:
        assert len(live) == 3 * mmap.PAGESIZE + 5
        assert [live[i] for i in range(0, len(live), mmap.PAGESIZE)] == [1, 1, 1, 1]
    finally:
        live.close()
