"""The training side of ``async_mode="bytes"``: the byte writer process, and the stream DCP writes into.

DCP runs the save on a thread of the training process, as in thread mode,
but each data file it writes is a ``RemoteStream``: it records what
``torch.save`` writes (its headers and writes under a page as bytes, each
write that lies in a staging buffer of ``shared_arena`` as a reference) and,
when DCP asks for the file's descriptor to fsync it or closes it, hands the
recipe to the byte writer process (``byte_writer``) and waits for it. That process maps
each arena chunk once (its descriptor travels once, ``SCM_RIGHTS``), and is
told to unmap it when the chunk is closed here.

One byte writer process serves every manager of this Python process
(``PROCESS``); it is started by the first save that needs it and replaced
when a save finds it dead.
"""

from __future__ import annotations

import bisect
import collections
import errno
import io
import itertools
import os
import socket
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Iterable, Optional

import numpy as np

from .byte_writer import MAX_FDS, recv_message, send_message
from .item_stream import ItemBoundaries, combined_crc
from .shared_arena import ARENA, MIN_BYTES

SHARED_MIN = 64 << 10
"""Storages in torch's shared memory (DCP's pinned staging on a CUDA host) smaller than this are not mapped by the
byte writer: each costs a descriptor and a mapping there. Their bytes travel inside the recipe."""


class ByteWriterDied(ConnectionError):
    """The byte writer process ended while a save was using it."""


class _Replies:
    """The futures of one byte writer process's requests, by id; all failed once the process is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._closed = False

    def add(self, req_id: int) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise ByteWriterDied(errno.EPIPE, "the checkpoint byte writer process is gone")
            self._futures[req_id] = fut
        return fut

    def pop(self, req_id: int) -> Optional[Future]:
        with self._lock:
            return self._futures.pop(req_id, None)

    def fail_all(self) -> None:
        with self._lock:
            self._closed = True
            futures, self._futures = list(self._futures.values()), {}
        for fut in futures:
            fut.set_exception(ByteWriterDied(errno.EPIPE, "the checkpoint byte writer process ended during a save"))


class ByteWriterProcess:
    """The byte writer process of this Python process, its socket, and what it has mapped."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self.generation = 0
        """How many processes were started: tokens are valid in the generation that mapped them only."""
        self._sock: Optional[socket.socket] = None
        self._replies = _Replies()
        self._ids = itertools.count()
        self._tokens = itertools.count()
        self._mapped: dict[int, tuple[int, int, Any]] = {}
        """address -> (token, bytes, weak reference to the storage) of each buffer the process holds."""
        self._starts: list[int] = []
        self._dead: collections.deque[int] = collections.deque()
        """Tokens of buffers freed here, to release there with the next message."""

    # ------------------------------------------------------------ process
    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def _ensure(self) -> tuple[socket.socket, _Replies, int]:
        """The live process's socket, its replies and its generation; a new process if there is none."""
        with self._lock:
            if self._sock is not None and self._proc is not None and self._proc.poll() is None:
                return self._sock, self._replies, self.generation
            self._shutdown_locked()
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            code = (f"import sys; sys.path.insert(0, {root!r}); from ckpt_core.byte_writer import main; "
                    f"main({child.fileno()}, {os.getpid()})")
            try:
                self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child.fileno(),),
                                              stdin=subprocess.DEVNULL, close_fds=True)
            finally:
                child.close()
            self._sock, self._replies = parent, _Replies()
            self.generation += 1
            self._mapped.clear()
            self._starts = []
            self._dead.clear()
            threading.Thread(target=self._read, args=(parent, self._replies), name="ckpt-bytes-replies",
                             daemon=True).start()
            return parent, self._replies, self.generation

    def _read(self, sock: socket.socket, replies: _Replies) -> None:
        """Hand each reply to the future of its request; fail them all once the process is gone."""
        try:
            while True:
                got = recv_message(sock)
                if got is None:
                    break
                (kind, req_id, value), _ = got
                fut = replies.pop(req_id)
                if fut is None:
                    continue
                if kind == "ok":
                    fut.set_result(value)
                else:
                    code, message = value
                    fut.set_exception(OSError(code, message) if code else RuntimeError(message))
        except (OSError, EOFError, ValueError):
            pass
        replies.fail_all()

    def _shutdown_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    # ------------------------------------------------------------ buffers
    def lookup(self, address: int, nbytes: int) -> Optional[tuple[int, int]]:
        """(token, offset) of ``address..address+nbytes`` in a buffer the process holds, else None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            start = self._starts[i]
            token, size, ref = self._mapped[start]
            if address + nbytes > start + size or ref() is None:
                return None
            return token, address - start

    def hold(self, storages: Iterable[Any]) -> int:
        """Make sure the process maps every shared CPU storage of ``storages`` (sent once each); the
        process's generation, which a request naming their tokens must give."""
        new: list[tuple[int, int, Any, int]] = []
        with self._lock:  # one generation: a process replaced meanwhile starts with nothing mapped
            sock, _replies, generation = self._ensure()
            for addr in [a for a, (_t, _n, ref) in self._mapped.items() if ref() is None]:
                del self._mapped[addr]
            for st in storages:
                where = _buffer_of(st)
                if where is None:
                    continue
                addr, size, fd, owner = where
                known = self._mapped.get(addr)
                if known is not None and known[2]() is owner and known[1] == size:
                    continue
                token = next(self._tokens)
                self._mapped[addr] = (token, size, weakref.ref(owner, self._freed(token)))
                new.append((token, size, owner, fd))
            self._starts = sorted(self._mapped)
        try:
            for i in range(0, len(new), MAX_FDS):
                batch = new[i : i + MAX_FDS]
                self._send(sock, ("map", [(t, n) for t, n, _st, _fd in batch]), tuple(fd for *_, fd in batch))
        except OSError as e:
            raise ByteWriterDied(errno.EPIPE, f"the checkpoint byte writer process is gone: {e}") from None
        return generation

    def _freed(self, token: int) -> Any:
        def callback(_ref: Any) -> None:  # the storage was freed: unmap it there with the next message
            self._dead.append(token)  # no lock: this may run inside hold(), wherever the collector runs
        return callback

    def release_freed(self) -> None:
        """Tell the process now about buffers freed here (a closed manager), not with the next save."""
        if self._dead and self._sock is not None:
            try:
                self._send(self._sock, None)
            except OSError:
                pass

    # ------------------------------------------------------------ requests
    def _send(self, sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
        with self._send_lock:
            dead = [self._dead.popleft() for _ in range(len(self._dead))]
            if dead:
                send_message(sock, ("release", dead))
            if message is not None:
                send_message(sock, message, fds)

    def request(self, kind: str, *args: Any, fds: tuple[int, ...] = (), generation: Optional[int] = None) -> Future:
        """Send a request; the future of its reply (``ByteWriterDied`` if the process ends first, or if it is
        not the ``generation`` that mapped the buffers the request names)."""
        sock, replies, live = self._ensure()
        if generation is not None and generation != live:
            raise ByteWriterDied(errno.EPIPE, "the checkpoint byte writer process was replaced during a save")
        req_id = next(self._ids)
        fut = replies.add(req_id)
        try:
            self._send(sock, (kind, req_id, *args), fds)
        except OSError as e:
            replies.pop(req_id)
            raise ByteWriterDied(errno.EPIPE, f"the checkpoint byte writer process is gone: {e}") from None
        return fut


def _buffer_of(storage: Any) -> Optional[tuple[int, int, int, Any]]:
    """(address, bytes, descriptor, owner) of the buffer the byte writer maps to read ``storage``: its arena
    chunk, or the storage itself in torch's shared memory (``file_descriptor`` strategy); None if neither.
    The buffer is released there once ``owner`` is freed here."""
    if storage.device.type != "cpu":
        return None
    chunk = ARENA.find(storage.data_ptr(), storage.nbytes())
    if chunk is not None:
        return chunk
    if storage.nbytes() < SHARED_MIN or not storage.is_shared():
        return None
    try:
        fd, _size = storage._share_fd_cpu_()
    except (RuntimeError, AttributeError):
        return None
    return storage.data_ptr(), storage.nbytes(), fd, storage


PROCESS = ByteWriterProcess()
"""The byte writer process of this Python process."""


class RemoteSave:
    """One rank's save in bytes mode: the process, and the fingerprint sums it took (by fingerprint id)."""

    def __init__(self, process: ByteWriterProcess, nice: int = 0) -> None:
        self.process = process
        self.nice = nice
        self.generation = 0
        """The process generation that mapped this attempt's buffers (``ByteWriterProcess.hold``)."""
        self.fp_ids: dict[tuple[int, int], tuple[int, str]] = {}
        """(address, bytes) of each staged tensor to fingerprint -> (id, torch dtype name)."""
        self.sums: dict[int, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def piece(self, mv: memoryview) -> Optional[tuple]:
        """A reference to ``mv`` in a staging buffer the process maps, else None (send its bytes)."""
        if len(mv) < MIN_BYTES:
            return None
        address = np.frombuffer(mv, dtype=np.uint8).ctypes.data
        where = self.process.lookup(address, len(mv))
        if where is None:
            return None
        fp = self.fp_ids.get((address, len(mv)))
        return (where[0], where[1], len(mv), fp[1] if fp else None, fp[0] if fp else None)

    def add_sums(self, sums: dict) -> None:
        with self._lock:
            self.sums.update(sums)


class RemoteStream(ItemBoundaries, io.RawIOBase):
    """A data file written by the byte writer process: DCP's items cut at ``tell`` (``item_stream``),
    recorded here and written there when DCP asks for the descriptor (to fsync) or closes the stream."""

    def __init__(self, fd: int, save: RemoteSave, direct: bool, sync: bool, sha256: bool, align: int = 0) -> None:
        self._fd, self._save = fd, save
        self._spec = {"direct": direct, "sync": sync, "sha256": sha256, "nice": save.nice}
        self._align = align
        self._wrote = False
        self._pieces: list[list] = [[]]
        self._inline = bytearray()
        self._sent = False
        self.size = 0
        self.sha256 = None
        self.segments: list[tuple[int, int, int]] = []
        self.segment_sha256: dict[int, str] = {}

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        ref = self._save.piece(mv)
        if ref is None:
            self._inline += mv
        else:
            self._flush_inline()
            self._pieces[-1].append(ref)
        self.size += len(mv)
        self._wrote = True
        return len(mv)

    def _flush_inline(self) -> None:
        if self._inline:
            self._pieces[-1].append(self._inline)  # no copy: a new buffer takes the next bytes
            self._inline = bytearray()

    def _cut(self) -> None:
        self._flush_inline()
        if self._pieces[-1]:
            self._pieces.append([])

    @property
    def crc(self) -> int:
        """CRC32C of the file, combined from the segments' (once written)."""
        return combined_crc(self.segments)

    def _write_remote(self) -> None:
        if self._sent:
            return
        self._sent = True
        self._cut()
        spec = dict(self._spec, segments=[p for p in self._pieces if p])
        save = self._save
        result = save.process.request("write", spec, fds=(self._fd,), generation=save.generation).result()
        self.segments = result["segments"]
        self.segment_sha256 = result["sha256"]
        self._save.add_sums(result["sums"])

    def fileno(self) -> int:
        self._write_remote()
        return self._fd

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._write_remote()
        finally:
            self.discard()

    def discard(self) -> None:
        """Close the descriptor without writing (a failed save; the file is left torn, uncommitted)."""
        if not self.closed:
            self._sent = True
            os.close(self._fd)
            super().close()


def open_data_file(path: str, direct: bool) -> tuple[int, bool]:
    """``path`` created (truncated) for writing: (descriptor, opened with ``O_DIRECT``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag:
        try:
            return os.open(path, flags | flag, 0o666), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False
