"""The staging arena of async_mode="bytes": free ranges never overlap and coalesce; storages are page-aligned,
exact and independent; freed pages and empty chunks go back to the system."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import given, strategies as st

from ckpt_core.shared_arena import PAGE, Arena, FreeList, page_round


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=80))
def test_free_ranges_never_overlap_what_is_taken_and_stay_merged(ops):
    size = 64
    fl, taken = FreeList(size), {}
    for take, n, pick in ops:
        if take or not taken:
            off = fl.take(n)
            if off is None:
                assert all(length < n for _off, length in fl.ranges)
                continue
            assert 0 <= off and off + n <= size
            assert all(off + n <= o or o + m <= off for o, m in taken.items())
            taken[off] = n
        else:
            off = sorted(taken)[pick % len(taken)]
            fl.give(off, taken.pop(off))
        used = sorted(taken.items())
        assert sum(m for _o, m in fl.ranges) + sum(m for _o, m in used) == size
        assert all(a[0] + a[1] < b[0] for a, b in zip(fl.ranges, fl.ranges[1:]))  # sorted, never adjacent
        for o, m in fl.ranges:
            assert all(o + m <= t or t + k <= o for t, k in used)
    for off, n in list(taken.items()):
        fl.give(off, n)
    assert fl.empty()


def test_giving_back_a_free_range_is_refused():
    fl = FreeList(10)
    off = fl.take(4)
    fl.give(off, 4)
    with pytest.raises(ValueError, match="already free"):
        fl.give(off, 4)


def _u8(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _memfds() -> int:
    fd_dir = "/proc/self/fd"
    count = 0
    for name in os.listdir(fd_dir):
        try:
            count += "memfd:ckpt-staging" in os.readlink(f"{fd_dir}/{name}")
        except OSError:
            pass
    return count


def test_storages_are_page_aligned_exact_and_share_a_chunk_and_a_descriptor():
    arena = Arena(chunk_bytes=1 << 20)
    before = _memfds()
    sizes = [1, 4096, 4097, 100_000, 3]
    stores = [arena.storage(n) for n in sizes]
    assert [s.nbytes() for s in stores] == sizes
    assert all(s.data_ptr() % PAGE == 0 for s in stores)
    ends = sorted((s.data_ptr(), s.data_ptr() + page_round(s.nbytes())) for s in stores)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    for i, s in enumerate(stores):
        _u8(s).fill_(i + 1)
    assert [set(_u8(s).tolist()) for s in stores] == [{i + 1} for i in range(5)]
    assert arena.chunks() == 1 and 1 <= _memfds() - before <= 2  # Python's mmap keeps a copy of the descriptor
    big = arena.storage(3 << 20)  # larger than a chunk: one of its own
    assert arena.chunks() == 2 and arena.find(big.data_ptr(), big.nbytes())[1] == page_round(3 << 20)
    del big, stores, s
    gc.collect()
    arena.trim()
    assert arena.chunks() == 0 and _memfds() == before


def test_a_freed_range_returns_its_pages_and_is_handed_out_again():
    arena = Arena(chunk_bytes=1 << 20)
    keep = arena.storage(PAGE)
    s = arena.storage(256 << 10)
    _u8(s).fill_(7)
    address = s.data_ptr()
    fd = arena.find(address, 1)[2]
    held = os.fstat(fd).st_blocks * 512
    assert held >= (256 << 10)
    del s
    gc.collect()
    arena.trim()
    assert os.fstat(fd).st_blocks * 512 <= held - (256 << 10)
    again = arena.storage(256 << 10)
    assert again.data_ptr() == address and set(_u8(again).tolist()) == {0}
    del keep, again


def test_a_free_that_finds_the_arena_busy_waits_for_the_next_call():
    arena = Arena(chunk_bytes=1 << 20)
    s = arena.storage(PAGE)
    with arena._lock:  # as when the collector frees a storage inside an allocation
        del s
        gc.collect()
        assert arena._chunks  # queued, not applied
    arena.trim()
    assert arena.chunks() == 0
