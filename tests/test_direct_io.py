"""Data files written with O_DIRECT: exact bytes whatever the write pattern, nothing in the page cache, a
buffered fallback where the file system refuses, and a failed write that commits nothing."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_core import CheckpointManager, TrainState
from ckpt_core import direct_io as dio
from ckpt_core.discovery import list_records

_LIBC = ctypes.CDLL(None, use_errno=True)


def resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a mapping, which itself faults nothing in)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        arr = np.frombuffer(m, dtype=np.uint8)
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        rc = _LIBC.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
        del arr
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"mincore on {path}")
    return sum(v & 1 for v in vec)


def _direct(path, chunk: int = 2 * dio.BLOCK) -> dio.DirectFile:
    f = dio.open_direct(str(path), chunk=chunk)
    if f is None:
        pytest.skip(f"{path} is on a file system without O_DIRECT")
    return f


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 3 * 2 * dio.BLOCK + 17), max_size=12), seed=st.integers(0, 2**16))
def test_a_direct_file_holds_exactly_the_bytes_written_whatever_their_sizes(tmp_path, sizes, seed):
    """Writes of any size, across chunk and block boundaries, give the same file as a buffered write."""
    gen = torch.Generator().manual_seed(seed)
    parts = [bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).tolist()) for n in sizes]
    path = tmp_path / "f.distcp"
    f = _direct(path)
    for p in parts:
        assert f.write(memoryview(p)) == len(p)
    assert f.tell() == sum(sizes)
    f.close()
    assert f.direct
    assert path.read_bytes() == b"".join(parts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 3 * 2 * dio.BLOCK + 17), max_size=12), seed=st.integers(0, 2**16),
       start=st.integers(0, 2**32 - 1))
def test_the_crc_taken_on_the_buffer_is_the_crc_of_the_bytes_written(tmp_path, monkeypatch, sizes, seed, start):
    """``write_crc`` extends a running CRC32C from its aligned copy, slice by slice (a slice here does not divide
    the block or the chunk): the result is the CRC of the bytes, and the file holds exactly them."""
    import crc32c

    monkeypatch.setattr(dio, "CRC_SLICE", 3001)
    gen = torch.Generator().manual_seed(seed)
    parts = [bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).tolist()) for n in sizes]
    path = tmp_path / "f.distcp"
    f = _direct(path)
    crc = start
    for p in parts:
        n, crc = f.write_crc(memoryview(p), crc)
        assert n == len(p)
    f.close()
    assert crc == crc32c.crc32c(b"".join(parts), start)
    assert path.read_bytes() == b"".join(parts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=st.lists(st.tuples(st.integers(0, 5 * dio.BLOCK + 17), st.booleans(), st.integers(0, dio.BLOCK)),
                       max_size=10),
       seed=st.integers(0, 2**16))
def test_writes_from_memory_aligned_as_the_file_go_out_straight_and_exactly(tmp_path, monkeypatch, writes, seed):
    """Each write of ``n`` bytes comes from a page-aligned buffer, either at the file position's offset from a
    block boundary (``congruent``: its whole blocks are written from the source itself) or at ``shift``
    (copied): the file and the CRC are exact either way, and every congruent write of a block or more past its
    head went out straight."""
    import crc32c

    monkeypatch.setattr(dio, "STRAIGHT_MIN", dio.BLOCK)
    straight: list[int] = []
    real = dio.DirectFile._write_straight
    monkeypatch.setattr(dio.DirectFile, "_write_straight",
                        lambda self, src, crc: (straight.append(len(src)), real(self, src, crc))[1])
    gen = torch.Generator().manual_seed(seed)
    source = mmap.mmap(-1, 8 * dio.BLOCK)
    source[:] = bytes(torch.randint(0, 256, (len(source),), dtype=torch.uint8, generator=gen).tolist())
    path = tmp_path / "f.distcp"
    f = _direct(path)
    expected, want = [], 0
    for n, congruent, shift in writes:
        pos = f.tell()
        at = pos % dio.BLOCK if congruent else shift
        part = memoryview(source)[at : at + n]
        n_written, crc = f.write_crc(part, crc32c.crc32c(b"".join(expected)))
        expected.append(bytes(part))
        assert (n_written, crc) == (len(part), crc32c.crc32c(b"".join(expected)))
        head = -pos % dio.BLOCK
        if (at - pos) % dio.BLOCK == 0 and len(part) >= max(dio.BLOCK, head + dio.BLOCK):
            want += (len(part) - head) // dio.BLOCK * dio.BLOCK
        part.release()
    f.close()
    source.close()
    assert path.read_bytes() == b"".join(expected)
    assert sum(straight) == want


def test_the_descriptor_is_opened_with_o_direct_and_reuses_its_buffers(tmp_path):
    import fcntl

    f = _direct(tmp_path / "a", chunk=dio.CHUNK)
    assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    buf = f._buf
    f.write(b"x" * 5000)
    f.close()
    g = _direct(tmp_path / "b", chunk=dio.CHUNK)
    assert g._buf is buf  # the pool hands the same warm buffer to the next file
    g.close()
    assert (tmp_path / "b").read_bytes() == b""


def test_a_write_the_file_system_rejects_as_misaligned_goes_on_buffered(tmp_path):
    """The kernel's own EINVAL (a buffer not aligned for O_DIRECT): the descriptor drops O_DIRECT, no byte is lost."""
    f = _direct(tmp_path / "f", chunk=2 * dio.BLOCK)
    f._view = None
    f._buf.close()
    f._buf = memoryview(bytearray(2 * dio.BLOCK + 1))[1:]  # one byte past malloc's alignment
    f._view = np.frombuffer(f._buf, dtype=np.uint8)
    data = bytes(range(256)) * 40
    f.write(data)
    f.close()
    assert not f.direct
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_without_o_direct_gets_buffered_writes(tmp_path):
    """ramfs refuses O_DIRECT at open: ``open_direct`` says so, and a save there is written the buffered way."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here (needs root)")
    try:
        assert dio.open_direct(str(mnt / "x")) is None
        model = torch.nn.Linear(64, 64)
        with CheckpointManager(str(mnt / "ckpt"), async_mode="off", lease=False, handle_preemption=False) as m:
            m.save(1, TrainState(model=model))
        assert [r.step for r in list_records(str(mnt / "ckpt")) if r.committed] == [1]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_save_leaves_its_data_files_out_of_the_page_cache(tmp_path, direct_io):
    """direct_io=True: no page of any data file is cached after the save (nothing was copied there); the
    buffered save, in the same test, leaves them cached, so the probe can tell the two apart."""
    model = torch.nn.Linear(512, 512)
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), async_mode="off", lease=False, handle_preemption=False,
                           direct_io=direct_io) as m:
        m.save(1, TrainState(model=model))
    files = sorted(root.glob("step_*/*.distcp"))
    assert files and sum(os.path.getsize(p) for p in files) > 512 * 512 * 4
    cached = sum(resident_pages(p) for p in files)
    assert (cached == 0) if direct_io else (cached > 0)
    again = torch.nn.Linear(512, 512)
    with CheckpointManager(str(root), lease=False, handle_preemption=False) as m:
        assert m.resume(TrainState(model=again)).step == 1
    assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)


def test_a_direct_write_that_fails_midway_commits_nothing_and_keeps_the_previous_checkpoint(tmp_path):
    """A real write error mid-file (RLIMIT_FSIZE: EFBIG from the kernel, in a child process): the save fails
    naming the cause, step 2 is never committed, step 1 still restores."""
    code = textwrap.dedent(f"""
        import resource, signal, torch
        from ckpt_core import CheckpointManager, TrainState
        from ckpt_core.errors import SaveError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        torch.manual_seed(0)
        small, big = torch.nn.Linear(8, 8), torch.nn.Linear(1024, 1024)
        m = CheckpointManager({str(tmp_path / "ckpt")!r}, async_mode="thread", lease=False, write_retries=0,
                              handle_preemption=False)
        m.save(1, TrainState(model=small)); m.wait()
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            m.save(2, TrainState(model=big)); m.wait()
        except SaveError as e:
            print("SAVE ERROR", e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        torch.save(small.state_dict(), {str(tmp_path / "small.pt")!r})
        m.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "SAVE ERROR checkpoint save at step 2 failed" in proc.stdout, proc.stdout + proc.stderr
    assert "File too large" in proc.stdout
    assert [(r.step, r.committed) for r in list_records(str(tmp_path / "ckpt"))] in ([(1, True)],
                                                                                      [(1, True), (2, False)])
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(str(tmp_path / "ckpt"), lease=False, handle_preemption=False) as m:
        assert m.resume(TrainState(model=model)).step == 1
    saved = torch.load(tmp_path / "small.pt")
    assert torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])
