"""Staging buffers for ``async_mode="bytes"``: page-aligned CPU storages carved out of a few ``memfd`` mappings.

The byte writer process (``byte_writer``) reads staged tensors from memory it
maps by descriptor. Staging each storage in torch's shared memory
(``share_memory_``) ties that to torch's sharing strategy: under the
``file_descriptor`` strategy every staged storage keeps a descriptor open (a
state of 3,000 tensors needs 3,000, past the common limit of 1,024 open
files), and under ``file_system`` there is no descriptor to send at all. Here
storages are cut from chunks of ``CHUNK_BYTES`` (a storage larger than that
gets a chunk of its own), each one ``memfd`` with one descriptor, whatever the
sharing strategy. A storage starts at a page boundary, so direct writes send
its whole blocks straight from it (``direct_io``), and a small one can be
referenced by the byte writer instead of copied into its recipe.

When a storage is freed its pages go back to the system (``MADV_REMOVE``) and
its range can be handed out again; a chunk with nothing left in it is closed.
Frees arrive from wherever torch frees the storage (the garbage collector
included), so a free that finds the arena busy is queued and applied by the
next call.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import threading
import weakref
from typing import Any, Optional

import numpy as np
import torch

PAGE = mmap.PAGESIZE
AVAILABLE = hasattr(os, "memfd_create") and hasattr(mmap, "MADV_REMOVE")
"""Whether this platform has what the arena needs (Linux); elsewhere bytes mode stages in torch's shared memory."""
MIN_BYTES = 4096
"""Storages smaller than this stay in private memory: their bytes travel inside the byte writer's recipe, which
costs less than a page of their own here and a reference there."""
CHUNK_BYTES = 64 << 20
"""Bytes of a chunk that storages share; untouched pages of a chunk take no memory (``memfd`` is sparse)."""


def page_round(n: int) -> int:
    """``n`` bytes rounded up to whole pages (at least one)."""
    return max(PAGE, -(-n // PAGE) * PAGE)


class FreeList:
    """The free ranges of one chunk, sorted and coalesced: first-fit ``take``, ``give`` merges neighbours."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranges: list[tuple[int, int]] = [(0, size)]
        """(offset, length) of each free range, by offset; adjacent ranges are always merged."""

    def take(self, n: int) -> Optional[int]:
        """The offset of ``n`` bytes now taken from the first free range that holds them; None if none does."""
        for i, (off, length) in enumerate(self.ranges):
            if length >= n:
                if length == n:
                    del self.ranges[i]
                else:
                    self.ranges[i] = (off + n, length - n)
                return off
        return None

    def give(self, off: int, n: int) -> None:
        """``off..off+n`` free again (it must have been taken)."""
        i = bisect.bisect_left(self.ranges, (off, 0))
        if i > 0 and sum(self.ranges[i - 1]) > off or i < len(self.ranges) and off + n > self.ranges[i][0]:
            raise ValueError(f"range {off}..{off + n} is already free")
        if i < len(self.ranges) and off + n == self.ranges[i][0]:
            n += self.ranges.pop(i)[1]
        if i > 0 and sum(self.ranges[i - 1]) == off:
            off, n = self.ranges[i - 1][0], self.ranges[i - 1][1] + n
            i -= 1
            del self.ranges[i]
        self.ranges.insert(i, (off, n))

    def empty(self) -> bool:
        """Whether nothing is taken."""
        return self.ranges == [(0, self.size)]


class Chunk:
    """One ``memfd`` mapping: its descriptor (open while the chunk is; Python's ``mmap`` holds a second one until
    the mapping goes), address, size and free ranges."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("ckpt-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.address = int(np.frombuffer(self.mm, dtype=np.uint8, count=1).ctypes.data)
        self.free = FreeList(size)

    def close(self) -> None:
        """Close the descriptor; the mapping goes once nothing refers to it (the byte writer is told then)."""
        os.close(self.fd)
        self.fd = -1


class Arena:
    """The chunks of this Python process, and the storages cut from them."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._chunks: dict[int, Chunk] = {}
        self._starts: list[int] = []
        self._pending: collections.deque[tuple[Chunk, int, int]] = collections.deque()

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """A CPU storage of ``nbytes`` bytes (at least 1) at a page boundary of a chunk; its range is freed with it."""
        n = page_round(nbytes)
        with self._lock:
            self._apply_frees()
            chunk, off = self._place(n)
        view = memoryview(chunk.mm)[off : off + max(nbytes, 1)]
        weakref.finalize(view, self._free, chunk, off, n).atexit = False  # at exit the memfd goes with the process
        return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()

    def _place(self, n: int) -> tuple[Chunk, int]:
        if n < self.chunk_bytes:
            for chunk in self._chunks.values():
                if chunk.size == self.chunk_bytes:
                    off = chunk.free.take(n)
                    if off is not None:
                        return chunk, off
        chunk = Chunk(max(n, self.chunk_bytes))
        self._chunks[chunk.address] = chunk
        self._starts = sorted(self._chunks)
        off = chunk.free.take(n)
        assert off == 0
        return chunk, off

    def _free(self, chunk: Chunk, off: int, n: int) -> None:
        self._pending.append((chunk, off, n))
        # busy (maybe on this very thread): the holder or the next call applies it
        if self._lock.acquire(blocking=False):
            try:
                self._apply_frees()
            finally:
                self._lock.release()

    def _apply_frees(self) -> None:
        while self._pending:
            chunk, off, n = self._pending.popleft()
            chunk.mm.madvise(mmap.MADV_REMOVE, off, n)
            chunk.free.give(off, n)
            if chunk.free.empty():
                del self._chunks[chunk.address]
                self._starts = sorted(self._chunks)
                chunk.close()

    def find(self, address: int, nbytes: int) -> Optional[tuple[int, int, int, Any]]:
        """(chunk address, chunk bytes, descriptor, mapping) of the live chunk holding ``address..+nbytes``."""
        with self._lock:
            self._apply_frees()
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            chunk = self._chunks[self._starts[i]]
            if address + nbytes > chunk.address + chunk.size:
                return None
            return chunk.address, chunk.size, chunk.fd, chunk.mm

    def trim(self) -> None:
        """Apply the frees still queued (their pages go back to the system, empty chunks close)."""
        with self._lock:
            self._apply_frees()

    def chunks(self) -> int:
        """How many chunks are open."""
        with self._lock:
            return len(self._chunks)


ARENA = Arena()
"""The staging arena of this Python process (every bytes-mode manager shares it)."""
