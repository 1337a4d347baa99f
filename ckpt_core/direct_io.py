"""Write a checkpoint's data files with ``O_DIRECT``: no copy into the page cache.

A buffered write copies every byte into page-cache pages in the kernel, then
the kernel's writeback threads write them out. On the 2-core development VM
that copy took 0.31 s of CPU per GiB right after another write and 2.7 s
per GiB after 5 s idle (freed memory goes back to the hypervisor there, so
pages taken later are first touches; docs/benchmarks.md, "Direct writes and
the page cache"). With ``O_DIRECT`` the device reads the bytes straight from
the writer's memory.

``O_DIRECT`` wants the memory address, the file offset and the length of each
write aligned to the device's block size, and the stream a DCP writer gets
(``torch.save``'s zip container: small headers, then each storage) is not
aligned. So bytes go through a page-aligned buffer (a copy between two warm
buffers in user space: about 0.1 s per GiB), written out in full aligned
chunks; the writer's CRC32C is taken on the buffer right after each 256 KiB
is copied in, from the cache (``write_crc``); at close the last partial
block is written padded and the file truncated to its real size. A save
whose files are block-aligned (``dcp_io._save_config``: each tensor's bytes
start at a block boundary) and staged in page-aligned memory (the shared
memory of ``async_mode="process"``) skips that copy for the whole blocks of
each large tensor: they are written straight from the staged tensor. Where the file system refuses ``O_DIRECT`` the
file is written the buffered way. A restore opens the same files with
``open_direct_read`` and takes its read buffers from the same pool
(``inplace_read``).
"""

from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os
import threading
from typing import Any, Optional

import crc32c
import numpy as np

BLOCK = 4096
"""Alignment of every direct write (covers 512-byte and 4 KiB logical blocks)."""

CHUNK = 8 << 20
"""Bytes per direct write (one buffer per open file)."""

CRC_SLICE = 256 << 10
"""Bytes copied into the buffer before their CRC32C is taken there (cache-sized)."""

STRAIGHT_MIN = 1 << 20
"""Writes of at least this many bytes go out straight from the caller's memory where its alignment allows."""

READ_CHUNK = 4 << 20
"""Bytes per direct read (``inplace_read``: one buffer per reading thread)."""

_POOL_MAX = 8
"""Buffers kept per size (one per writing or reading thread)."""
_POOL_SIZES = (CHUNK, READ_CHUNK)
"""The sizes kept: a direct write's and a direct read's buffers."""
_pool: dict[int, list[mmap.mmap]] = {}
_pool_lock = threading.Lock()


def take_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer of ``size`` bytes; those of the ``_POOL_SIZES`` are reused across saves and
    restores (memory freed and taken again costs a first touch on machines that return free memory to a
    hypervisor)."""
    with _pool_lock:
        kept = _pool.get(size)
        if kept:
            return kept.pop()
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: a fork copies on write


def give_buffer(buf: mmap.mmap) -> None:
    """Return a buffer of ``take_buffer``: kept for reuse if of a pooled size, else unmapped."""
    with _pool_lock:
        kept = _pool.setdefault(len(buf), []) if len(buf) in _POOL_SIZES else None
        if kept is not None and len(kept) < _POOL_MAX:
            kept.append(buf)
            return
    buf.close()


def open_direct(path: str, sync: bool = True, chunk: int = CHUNK) -> Optional["DirectFile"]:
    """``path`` created (truncated) for direct writes; None where its file system refuses ``O_DIRECT``.

    ``sync``: ``close`` ends with an fsync (the last block and the file's size are written then).
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o666)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    return DirectFile(fd, sync, chunk)


def open_direct_read(path: str) -> Optional[int]:
    """``path`` opened read-only with ``O_DIRECT`` (``inplace_read``); None where that is not available (the
    caller's buffered stream then reads, and reports any other problem with the file)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None


class DirectFile(io.RawIOBase):
    """A write-only file on an ``O_DIRECT`` descriptor, fed through an aligned buffer (see the module doc).

    ``close`` writes the last partial block, truncates the file to the bytes
    written and, with ``sync``, fsyncs it; until then the file may be shorter
    than what was written (``discard`` closes without writing more). If the
    file system rejects a direct write (``EINVAL``), the descriptor drops
    ``O_DIRECT`` and the file goes on buffered.
    """

    def __init__(self, fd: int, sync: bool = True, chunk: int = CHUNK) -> None:
        if chunk <= 0 or chunk % BLOCK:
            raise ValueError(f"chunk={chunk}: direct writes need a positive multiple of {BLOCK} bytes")
        super().__init__()
        self._fd = fd
        self._sync = sync
        self._chunk = chunk
        self._buf: Any = take_buffer(chunk)
        self._view = np.frombuffer(self._buf, dtype=np.uint8)
        self._fill = 0
        self.size = 0
        self.direct = True
        """Whether the file is still written with ``O_DIRECT`` (False after a fallback)."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self.size

    def write(self, b: Any) -> int:
        return self.write_crc(b, None)[0]

    def write_crc(self, b: Any, crc: Optional[int]) -> tuple[int, Optional[int]]:
        """Write ``b``; with ``crc`` (not None), also extend that CRC32C over ``b`` and return it.

        The CRC is taken from the aligned buffer right after each ``CRC_SLICE`` is
        copied in, while those bytes are still in the CPU's cache: the source is
        read from memory once, not once for the copy and once more for the CRC.
        Where ``b`` lies in memory at the same offset from a block boundary as
        in the file (a block-aligned storage of an aligned save,
        ``dcp_io._save_config``, staged in page-aligned shared memory), its
        whole blocks are written from ``b`` itself, with no copy (``_write_straight``).
        """
        src = np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8)
        if len(src) >= STRAIGHT_MIN and self.direct:
            head = -self._fill % BLOCK
            if (src.ctypes.data + head) % BLOCK == 0 and len(src) >= head + BLOCK:
                middle = head + (len(src) - head) // BLOCK * BLOCK
                crc = self._copy_in(src[:head], crc)
                if self._fill:
                    self._write_out(self._fill)
                    self._fill = 0
                crc = self._write_straight(src[head:middle], crc)
                crc = self._copy_in(src[middle:], crc)
                self.size += len(src)
                return len(src), crc
        crc = self._copy_in(src, crc)
        self.size += len(src)
        return len(src), crc

    def _write_straight(self, src: np.ndarray, crc: Optional[int]) -> Optional[int]:
        """Write whole blocks from ``src`` (block-aligned in memory) at the descriptor's aligned offset, each
        ``CHUNK`` into the CRC first."""
        for pos in range(0, len(src), self._chunk):
            piece = src[pos : pos + self._chunk]
            if crc is not None:
                crc = crc32c.crc32c(piece, crc)
            self._write_view(memoryview(piece))
        return crc

    def _copy_in(self, src: np.ndarray, crc: Optional[int]) -> Optional[int]:
        """Copy ``src`` into the aligned buffer (written out each time it fills), each slice into the CRC."""
        pos, n = 0, len(src)
        while pos < n:
            k = min(self._chunk - self._fill, n - pos, CRC_SLICE)
            dst = self._view[self._fill:self._fill + k]
            dst[:] = src[pos:pos + k]  # numpy copies without the GIL
            if crc is not None:
                crc = crc32c.crc32c(dst, crc)
            self._fill += k
            pos += k
            if self._fill == self._chunk:
                self._write_out(self._chunk)
                self._fill = 0
        return crc

    def _write_out(self, length: int) -> None:
        """Write ``buf[:length]`` (``length`` a multiple of ``BLOCK``) at the descriptor's offset."""
        view = memoryview(self._buf)[:length]
        try:
            self._write_view(view)
        finally:
            view.release()

    def _write_view(self, view: memoryview) -> None:
        """Write all of ``view`` (aligned address and length) at the descriptor's offset; on ``EINVAL``, on
        buffered."""
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._go_buffered()

    def _go_buffered(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._fill:
                padded = -(-self._fill // BLOCK) * BLOCK
                self._view[self._fill:padded] = 0
                self._write_out(padded)
            os.ftruncate(self._fd, self.size)
            if self._sync:
                os.fsync(self._fd)
        finally:
            self._release()
            super().close()

    def discard(self) -> None:
        """Close without writing the buffered bytes (the write failed; the file is left torn, uncommitted)."""
        if not self.closed:
            self._release()
            super().close()

    def _release(self) -> None:
        if self._buf is not None:
            self._view = None
            if isinstance(self._buf, mmap.mmap):
                give_buffer(self._buf)
            self._buf = None
        os.close(self._fd)
