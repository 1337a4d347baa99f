"""The byte writer process of ``async_mode="bytes"``: writes data files from shared memory, without torch.

A process-mode save runs DCP in a second Python process that imports torch:
about 190 MB of the host's memory per rank before it writes a byte (torch's
own allocations at import, 143 MB, and DCP's, 46 MB). This process imports
only numpy and ``crc32c`` (about 17 MB). DCP plans and serializes the save on a
thread of the training process (``byte_client``); what that thread would
write, the bytes of each data file, comes here as a recipe instead: small
byte strings (``torch.save``'s headers, small tensors) and references into
the shared-memory staging buffers, which this process maps once. It writes
each file (``O_DIRECT`` where the parent opened it so), takes the CRC32C of
each segment (DCP's items), the SHA-256 of each segment for a signed save,
and the fingerprint sums of each staged tensor in the same pass, fsyncs, and
replies with the figures.

Messages (a 12-byte header, then a pickle of plain data; only the training
process that started this one can write to its socket):

* ``("map", [(token, size), ...])`` with one descriptor per entry: buffers
  to map (read-only) under their tokens;
* ``("release", [token, ...])``: buffers the training side let go of;
* ``("write", id, spec)`` with the data file's descriptor: write it (on a
  thread of its own, so files are written in parallel), reply
  ``("ok", id, result)`` or ``("err", id, (errno, message))``;
* ``("ping", id)``: reply ``("ok", id, {"pid", "modules"})``.

The process ends when the training side closes its end of the socket (its
exit included) or when the training process is gone (a data-loader worker it
forked may still hold the socket).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pickle
import socket
import struct
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import crc32c
import numpy as np

from .array_sums import SumsCrc, numpy_dtype
from .direct_io import CHUNK, DirectFile

HEADER = struct.Struct("!QI")
"""(bytes of the pickled body, number of descriptors attached to the header)."""
MAX_FDS = 250
"""Descriptors per message at most (the kernel's limit for one ``SCM_RIGHTS`` message is 253)."""


def send_message(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """``message`` pickled behind a header; ``fds`` ride on the header (the caller serializes senders)."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = HEADER.pack(len(body), len(fds))
    if fds:
        sent = socket.send_fds(sock, [header], list(fds))
        if sent != len(header):
            sock.sendall(header[sent:])
    else:
        sock.sendall(header)
    sock.sendall(body)


def recv_message(sock: socket.socket) -> Optional[tuple[Any, list[int]]]:
    """The next message and the descriptors that came with it; None once the other side closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, MAX_FDS)
    if not data:
        return None
    header = data + _recv_exactly(sock, HEADER.size - len(data))
    length, nfds = HEADER.unpack(header)
    if nfds != len(fds):
        raise ConnectionError(f"expected {nfds} descriptors with a message, got {len(fds)}")
    return pickle.loads(_recv_exactly(sock, length)), fds


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("the other side closed the socket in the middle of a message")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class _PlainFile:
    """A buffered (page-cache) data file on a descriptor, with ``DirectFile``'s ``write_crc``/``close``."""

    def __init__(self, fd: int, sync: bool) -> None:
        self._fd, self._sync = fd, sync

    def write_crc(self, b: Any, crc: Optional[int]) -> tuple[int, Optional[int]]:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        return len(view), (crc32c.crc32c(view, crc) if crc is not None else None)

    def close(self) -> None:
        try:
            if self._sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def discard(self) -> None:
        os.close(self._fd)


class Writer:
    """This process's state: the mapped buffers by token, and the socket back to the training process."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.maps: dict[int, mmap.mmap] = {}
        self._closing: list[mmap.mmap] = []
        self._send_lock = threading.Lock()

    def reply(self, message: Any) -> None:
        with self._send_lock:
            send_message(self.sock, message)

    def map(self, entries: list[tuple[int, int]], fds: list[int]) -> None:
        for (token, size), fd in zip(entries, fds):
            try:
                self.maps[token] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)

    def release(self, tokens: list[int]) -> None:
        self._closing.extend(m for m in (self.maps.pop(t, None) for t in tokens) if m is not None)
        still = []
        for m in self._closing:
            try:
                m.close()
            except BufferError:  # a write still holds a view of it: closed at a later release
                still.append(m)
        self._closing = still

    def write(self, req_id: int, spec: dict, fd: int) -> None:
        try:
            nice = spec.get("nice", 0)
            if nice and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            result = write_file(fd, spec, self.maps)
        except Exception as e:  # noqa: BLE001 - reported to the training side, which raises it
            self.reply(("err", req_id, (getattr(e, "errno", None), f"{type(e).__name__}: {e}")))
            return
        self.reply(("ok", req_id, result))


def write_file(fd: int, spec: dict, maps: dict[int, mmap.mmap]) -> dict:
    """Write the recipe ``spec`` to ``fd`` (owned: closed here); its segments' figures."""
    out: Any = DirectFile(fd, spec["sync"]) if spec["direct"] else _PlainFile(fd, spec["sync"])
    try:
        offset, segments, sha, sums = 0, [], {}, {}
        for pieces in spec["segments"]:
            length, crc, digest = _write_segment(out, pieces, maps, spec["sha256"], sums)
            segments.append((offset, length, crc))
            if digest is not None:
                sha[offset] = digest
            offset += length
    except BaseException:
        out.discard()
        raise
    out.close()
    return {"segments": segments, "sha256": sha, "sums": sums,
            "direct": bool(getattr(out, "direct", False))}


def _write_segment(out: Any, pieces: list, maps: dict[int, mmap.mmap], with_sha: bool,
                   sums: dict) -> tuple[int, int, Optional[str]]:
    """Write one segment's pieces; (bytes, CRC32C, SHA-256 or None). Fingerprinted pieces add their sums
    to ``sums`` under their id."""
    crc, length = 0, 0
    digest = hashlib.sha256() if with_sha else None
    for piece in pieces:
        if isinstance(piece, (bytes, bytearray)):
            view = memoryview(piece)
            if digest is not None:
                digest.update(view)
            crc = out.write_crc(view, crc)[1]
            length += len(view)
            continue
        token, start, n, dtype, fp_id = piece
        view = memoryview(maps[token])[start : start + n]
        try:
            if dtype is None:
                if digest is not None:
                    digest.update(view)
                crc = out.write_crc(view, crc)[1]
            else:
                crc, sums[fp_id] = _write_summed(out, view, dtype, crc, digest)
        finally:
            view.release()
        length += n
    return length, crc, (digest.hexdigest() if digest is not None else None)


def _write_summed(out: Any, view: memoryview, dtype: str, crc: int, digest: Any) -> tuple[int, tuple]:
    """Write a staged tensor's bytes in slices, each summed and taken into the CRC (while in the cache) just
    before it is handed to a second thread that writes it; (the CRC, (sum, sum of |x|)). Summing a slice
    overlaps writing the one before: the slower of the two sets the pace, not their sum."""
    arr = np.frombuffer(view, dtype=numpy_dtype(dtype))
    acc = SumsCrc(arr.dtype, arr.size)
    acc.crc = crc
    step = CHUNK // arr.itemsize
    with _WriteBehind(out) as behind:
        for pos in range(0, arr.size, step):
            part = arr[pos : pos + step]
            acc.update(part)
            if digest is not None:
                digest.update(part)
            behind.write(part)
    del arr
    return int(acc.crc), (acc.s, acc.sa)


class _WriteBehind:
    """Writes to ``out`` on a thread of its own, in order, at most one write outstanding: ``write`` waits for
    the previous one (and raises its error), then starts this one."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None

    def write(self, part: Any) -> None:
        self._wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-bytes-behind")
        self._pending = self._pool.submit(self._out.write_crc, part, None)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def __enter__(self) -> "_WriteBehind":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def serve(sock: socket.socket) -> None:
    """Answer the training process until it closes the socket."""
    w = Writer(sock)
    while True:
        got = recv_message(sock)
        if got is None:
            return
        (kind, *args), fds = got
        if kind == "map":
            w.map(args[0], fds)
        elif kind == "release":
            w.release(args[0])
        elif kind == "write":
            threading.Thread(target=w.write, args=(args[0], args[1], fds[0]), name="ckpt-bytes-write",
                             daemon=True).start()
        elif kind == "ping":
            w.reply(("ok", args[0], {"pid": os.getpid(), "modules": sorted(sys.modules)}))
        else:
            for fd in fds:
                os.close(fd)


def _exit_with(parent: int) -> None:
    """Exit once ``parent`` is gone (re-parented), even while a process it forked still holds its socket."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="ckpt-bytes-parent-watch", daemon=True).start()


def main(fd: int, parent: int) -> None:
    """Entry point: serve on the inherited socket ``fd``; exit when the training process ``parent`` goes away
    (its socket closes, or this process is re-parented)."""
    _exit_with(parent)
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    except (ConnectionError, OSError, EOFError):
        pass
    finally:
        sock.close()
