"""DCP storage edge: writers that checksum while writing and commit last, readers that verify what they read.

The commit writers (``LocalCommitWriter``, ``FsspecCommitWriter``) are DCP's
own file-system writers with three additions:

* every byte written goes through a CRC32C stream, one checksum per DCP item
  (file, offset, length), so sizes and checksums are known without reading
  anything back; a file's checksum is combined from its items';
* each rank leaves a small JSON sidecar (its files, its items' checksums, its
  share of the state fingerprint, the checkpoint's id and step) once its data
  is durable;
* the coordinator's ``finish`` (which DCP runs only after every rank's data is
  written) writes DCP's ``.metadata`` and then ``manifest.json``: the commit.

The safe readers unpickle ``.metadata`` with an exact allowlist
(``safe_pickle``) and, given the manifest, check ``.metadata``, the sidecars
and every item a load reads against the checksums recorded at write time
(``integrity``).

Because all of this happens inside DCP's save, it runs wherever DCP runs the
save: inline, in a background thread, or in the background process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import math
import os
import threading
import time
from functools import partial
from typing import Any, Iterator, Mapping, Optional

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType

from . import fingerprint as fp
from .byte_client import RemoteSave, RemoteStream, open_data_file
from .crc_combine import crc32c_combine
from .direct_io import BLOCK, open_direct
from .inplace_read import read_in_place
from .item_stream import ItemBoundaries, combined_crc
from .integrity import CheckpointVerifier
from .manifest import FileEntry, Manifest, build_manifest
from .planner import placed_for_load
from .safe_pickle import load_dcp_metadata
from .signing import sha256_hex
from .staged_crc import StagedCrcs
from .sidecar import ItemKey, Sidecar, SidecarError, parse_sidecar, sidecar_name
from .storage import DCP_METADATA_NAME, MANIFEST_NAME, get_fs, is_local, join, read_many, write_bytes_durable

log = logging.getLogger("ckpt_core")

DATA_SUFFIX = ".distcp"
"""DCP's data files: the only files written with ``O_DIRECT`` (the others are small)."""

_WATCHING = False


def exit_with_parent() -> None:
    """In a spawned process (DCP's checkpoint writer), exit when the process that spawned it dies.

    DCP's writer process is a daemon, which only helps on a clean exit: after a
    SIGKILL of the trainer it would linger, possibly blocked in a collective
    with writers of other ranks. A checkpoint it had not committed stays
    uncommitted, so exiting is always safe.
    """
    import multiprocessing

    global _WATCHING
    parent = multiprocessing.parent_process()  # None while a spawned process imports its parent's main module
    if parent is None or _WATCHING:
        return
    _WATCHING = True
    ppid = parent.pid  # not os.getppid(): the parent may have died (and this process been re-parented) already

    def watch() -> None:
        while True:
            if os.getppid() != ppid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="ckpt-parent-watch").start()


exit_with_parent()


def renice_threads(nice: int) -> None:
    """Every thread of this process to at least ``nice`` (Linux's nice is per thread; a new thread inherits its
    creator's). Never raises priority, never fails: a thread that ended or may not be changed is left as it is."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)


def _write_then_crc(raw: Any, mv: memoryview, crc: Optional[int]) -> tuple[Any, Optional[int]]:
    """``raw.write(mv)`` and the CRC32C ``crc`` extended over ``mv`` (a stream without ``write_crc``); no
    CRC when ``crc`` is None."""
    return raw.write(mv), (crc32c.crc32c(mv, crc) if crc is not None else None)


STAGED_MIN = 1 << 20
"""Writes of at least this many bytes may take their CRC32C from the fingerprint pass (``staged_crc``)."""


def _staged_crc(owner: "_HashingFileSystem", mv: memoryview) -> Optional[int]:
    """The CRC32C of ``mv`` from the save's fingerprint pass, where ``mv`` is exactly a staged tensor's bytes
    and the pass took it (else None: the stream takes it)."""
    crcs = owner.staged_crcs
    if crcs is None or len(mv) < STAGED_MIN:
        return None
    return crcs.take((np.frombuffer(mv, dtype=np.uint8).ctypes.data, len(mv)))


class _HashingStream(ItemBoundaries, io.RawIOBase):
    """Forwards writes to ``raw`` while keeping a CRC32C per segment: DCP's items, cut at ``tell``
    (``item_stream``)."""

    def __init__(self, raw: Any, owner: "_HashingFileSystem", sha256: bool = False, align: int = 0) -> None:
        self._raw = raw
        self._align = align
        self._wrote = False
        self._write = getattr(raw, "write_crc", None) or partial(_write_then_crc, raw)  # direct: on its copy
        self._owner = owner
        self.sha256 = hashlib.sha256() if sha256 else None
        """SHA-256 of the whole file (small files: ``.metadata``), for the digests of a signed manifest."""
        self.size = 0
        self._seg_start = 0
        self._seg_crc = 0
        self.segments: list[tuple[int, int, int]] = []
        """(offset, length, crc32c) of each segment, in file order."""
        self._seg_sha = hashlib.sha256() if owner.item_sha256 else None
        self.segment_sha256: dict[int, str] = {}
        """SHA-256 (hex) of each segment by offset, when the owner records them (signed saves)."""

    def writable(self) -> bool:
        return True

    def _cut(self) -> None:
        if self.size > self._seg_start:
            self.segments.append((self._seg_start, self.size - self._seg_start, self._seg_crc))
            if self._seg_sha is not None:
                self.segment_sha256[self._seg_start] = self._seg_sha.hexdigest()
        self._seg_start, self._seg_crc = self.size, 0
        if self._seg_sha is not None:
            self._seg_sha = hashlib.sha256()

    @property
    def crc(self) -> int:
        """CRC32C of everything written so far, combined from the segments'."""
        self._cut()
        return combined_crc(self.segments)

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if self.sha256 is not None:
            self.sha256.update(mv)
        if self._seg_sha is not None:
            self._seg_sha.update(mv)
        staged = _staged_crc(self._owner, mv)
        try:
            if staged is None:
                n, self._seg_crc = self._write(mv, self._seg_crc)
            else:
                n, _ = self._write(mv, None)
                self._seg_crc = crc32c_combine(self._seg_crc, staged, len(mv))
        except Exception as e:
            # torch.save's zip writer replaces I/O errors by its own; keep the real cause
            self._owner.last_error = e
            raise
        n = len(mv) if n is None else n
        self.size += n
        self._wrote = True
        return n

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()
            try:
                self._raw.close()  # a direct file writes its last block here
            except Exception as e:
                self._owner.last_error = e
                raise


def _save_config(align: int = 0) -> Any:
    """Turn off the CRC32 that ``torch.save``'s zip container computes, for the current thread only; with
    ``align``, also start each storage's bytes at a multiple of ``align`` in its archive.

    DCP writes each tensor with ``torch.save``; that CRC costs ~0.35 s per GiB
    (measured: ``torch.save`` of 1 GiB into an fsync'd file 1.20 s with it,
    0.82 s without, a raw write 0.90 s) and adds nothing here, since every file
    gets a CRC32C in the same pass, which discovery verifies; ``torch.load``
    reads the files either way. From torch 2.12 on, config patches are
    context-local, so a ``torch.save`` the user runs on another thread keeps its
    CRC; before that a patch is process-wide (and overlapping patches from
    several writer threads could leave it off), so the CRC is kept there. DCP's
    writer threads open their files through ``create_stream``, which is why the
    patch lives there.

    The alignment (with the stream's, which starts each item at a multiple of
    ``align``) puts every tensor's bytes at a block boundary of the file, where
    ``O_DIRECT`` can write them from the staging buffer and read them into the
    load buffer without a copy (``direct_io``, ``inplace_read``). It costs up to
    ``2 * align`` bytes per item.
    """
    from torch.utils.serialization import config

    if not _CONFIG_PATCHES_ARE_CONTEXT_LOCAL:
        return contextlib.nullcontext()
    patch: dict[str, Any] = {"save.compute_crc32": False}
    if align:
        patch["save.storage_alignment"] = align
    return config.patch(patch)


def _config_patches_are_context_local() -> bool:
    from contextvars import ContextVar

    from torch.utils.serialization import config

    entry = getattr(config, "_config", {}).get("save.compute_crc32")
    return isinstance(getattr(entry, "user_override", None), ContextVar)


_CONFIG_PATCHES_ARE_CONTEXT_LOCAL = _config_patches_are_context_local()

ALIGN_MIN = 1 << 20
"""A rank's data files are block-aligned (``_save_config``) only when one of its tensors has this many bytes."""
ALIGN_COST = 8 * BLOCK
"""Bytes an aligned layout adds per tensor item at most: the item's start and each of the (up to seven) records
of its ``torch.save`` archive padded to a block."""
ALIGN_OVERHEAD = 0.01
"""The most an aligned layout may add to a rank's bytes, as a fraction (many small tensors: packed)."""


def aligns(item_bytes: list[int]) -> bool:
    """Whether a rank's data files are block-aligned, given the bytes of each of its tensor items (pure):
    some item has ``ALIGN_MIN`` bytes and the padding adds at most ``ALIGN_OVERHEAD`` to the total."""
    tensors = [n for n in item_bytes if n > 0]
    return max(tensors, default=0) >= ALIGN_MIN and len(tensors) * ALIGN_COST <= ALIGN_OVERHEAD * sum(tensors)


class _HashingFileSystem:
    """Wraps a DCP ``FileSystemBase``; records (size, crc32c) and the segments of every file it writes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.records: dict[str, tuple[int, int]] = {}
        self.segments: dict[str, list[tuple[int, int, int]]] = {}
        self.digests: dict[str, str] = {}
        self.item_sha256 = False
        """Whether streams also keep a SHA-256 per segment (a signed save: DCP items get one each)."""
        self.segment_sha256: dict[str, dict[int, str]] = {}
        self.last_error: Optional[BaseException] = None
        self.direct = False
        """Whether data files (``*.distcp``) are written with ``O_DIRECT`` (``direct_io``; local files only)."""
        self.sync = True
        """Whether a direct file is fsynced when closed (the writer's ``sync_files``)."""
        self.align = 0
        """Block size each item and each tensor's bytes start at in data files (0: packed; ``_save_config``)."""
        self.staged_crcs: Optional[StagedCrcs] = None
        """The CRC32Cs the running save's fingerprint pass takes of its staged tensors (``staged_crc``)."""
        self.remote: Optional[RemoteSave] = None
        """Where data files go in ``async_mode="bytes"``: the byte writer process (``byte_client``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        if self.remote is not None and "w" in mode and name.endswith(DATA_SUFFIX):
            with self._remote_stream(path, name) as stream:
                yield stream
            return
        direct = None
        if self.direct and "w" in mode and name.endswith(DATA_SUFFIX):
            direct = open_direct(os.fspath(path), self.sync)  # None where the file system refuses O_DIRECT
        align = self.align if name.endswith(DATA_SUFFIX) and _CONFIG_PATCHES_ARE_CONTEXT_LOCAL else 0
        if direct is not None:
            hashing = _HashingStream(direct, self, align=align)
            try:
                with _save_config(align):
                    yield hashing
                hashing.close()
            except BaseException:
                direct.discard()
                raise
        else:
            with self.inner.create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream, self, sha256=name.startswith(DCP_METADATA_NAME), align=align)
                with _save_config(align):
                    yield hashing
        self._record(name, hashing)

    @contextlib.contextmanager
    def _remote_stream(self, path: Any, name: str) -> Iterator[Any]:
        """A data file recorded here and written by the byte writer process (``byte_client.RemoteStream``)."""
        assert self.remote is not None
        try:
            fd, direct = open_data_file(os.fspath(path), self.direct)
        except Exception as e:
            self.last_error = e  # a writer thread of DCP's dies of it: the save reports this, not a short count
            raise
        align = self.align if _CONFIG_PATCHES_ARE_CONTEXT_LOCAL else 0
        stream = RemoteStream(fd, self.remote, direct, self.sync, self.item_sha256, align=align)
        try:
            with _save_config(align):
                yield stream
            stream.close()
        except BaseException as e:
            stream.discard()
            if isinstance(e, Exception):
                self.last_error = e
            raise
        self._record(name, stream)

    def _record(self, name: str, stream: Any) -> None:
        self.records[name] = (stream.size, stream.crc)
        self.segments[name] = stream.segments
        self.segment_sha256[name] = stream.segment_sha256
        if stream.sha256 is not None:
            self.digests[name] = stream.sha256.hexdigest()


_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT}


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error is worth retrying (network hiccups), not a full disk or a bad path."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    name = type(exc).__name__
    return name in ("ClientError", "EndpointConnectionError", "ReadTimeoutError", "ServerDisconnectedError")


def with_retries(fn: Any, what: str, retries: int, backoff_s: float) -> Any:
    """Call ``fn``; retry transient storage errors with exponential backoff."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            if attempt == retries or not is_transient(e):
                raise
            delay = backoff_s * (2**attempt)
            log.warning("ckpt_core: %s failed (%s: %s); retry %d/%d in %.2fs",
                        what, type(e).__name__, e, attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _crc_key(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """Where a fingerprinted tensor's bytes lie, if the pass can take their CRC32C (``staged_crc``)."""
    return (t.data_ptr(), t.numel() * t.element_size()) if fp.crc_fusable(t) else None


def _fingerprint_jobs(plan: Any, planner: Any) -> list[tuple[str, torch.Tensor, Optional[tuple[int, int]]]]:
    """(fqn, tensor, CRC key) of each tensor the plan writes that the fingerprint covers, largest first (as
    DCP's writer threads take a rank's items)."""
    jobs = [(item.index.fqn, planner.resolve_data(item)) for item in plan.items
            if item.type != WriteItemType.BYTE_IO and fp.is_fingerprinted(item.index.fqn)]
    return sorted(((fqn, t, _crc_key(t)) for fqn, t in jobs), key=lambda job: -job[1].nbytes)


def _start_fingerprint(plan: Any, planner: Any, sums: dict, errors: list
                       ) -> tuple[threading.Thread, StagedCrcs]:
    """Fingerprint the plan's tensors into ``sums`` on a thread of its own (an exception goes to ``errors``),
    taking the CRC32Cs the writer will want on the way (the ``StagedCrcs`` returned).

    A read-only pass over the tensors being written: it runs beside the write
    (numpy releases the GIL) instead of before it, hidden behind the storage.
    """
    keys = _fingerprint_jobs(plan, planner)
    crcs = StagedCrcs(key for _, _, key in keys if key is not None)

    def fingerprint() -> None:
        try:
            parts = []
            for fqn, t, key in keys:
                fused = key is not None and crcs.begin(key)
                entry, crc = fp.entry_and_crc(t, crc=fused)
                if fused:
                    crcs.done(key, crc)
                parts.append({fqn: entry})
            sums.update(fp.combine(parts))
        except BaseException as e:  # noqa: BLE001 - re-raised on the writing thread
            errors.append(e)
        finally:
            crcs.close()

    thread = threading.Thread(target=fingerprint, name="ckpt-fingerprint", daemon=True)
    thread.start()
    return thread, crcs


def _begin_remote(plan: Any, planner: Any, jobs: list, remote: RemoteSave) -> None:
    """Before each attempt: the byte writer process maps every staged buffer of the plan (a replaced
    process maps them again) and is asked to sum each staged tensor of ``jobs`` it writes whole."""
    remote.generation = remote.process.hold(planner.resolve_data(item).untyped_storage() for item in plan.items
                                            if item.type != WriteItemType.BYTE_IO)
    remote.fp_ids = {key: (i, str(t.dtype).rpartition(".")[2]) for i, (_fqn, t, key) in enumerate(jobs)
                     if key is not None}
    remote.sums = {}


def _remote_fingerprint(jobs: list, remote: RemoteSave) -> dict[str, fp.Entry]:
    """The fingerprint of ``jobs``: the byte writer process's sums where it took them, the rest summed here
    (tensors it did not get as a reference: small, non-contiguous, or of a dtype numpy does not sum)."""
    parts = []
    for i, (fqn, t, key) in enumerate(jobs):
        took = remote.fp_ids.get(key) if key is not None else None
        sums = remote.sums.get(took[0]) if took is not None and took[0] == i else None
        parts.append({fqn: (sums[0], sums[1], int(t.numel())) if sums is not None else fp.tensor_entry(t)})
    return fp.combine(parts)


def _item_bytes(item: Any) -> int:
    """Bytes of a tensor write item's chunk (0 for a byte item)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


class _NoCloseStream(io.IOBase):
    """An item's view of its data file: writes go through, ``close`` only flushes (the file holds more items)."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        self.flush()
        self.raw.flush()


class _ItemTransforms(_StorageWriterTransforms):
    """DCP's per-item stream transforms; without extensions, the stream it wraps each item in is one class
    defined once. DCP's own defines a new ``io.IOBase`` class for every item: a class and its reference
    cycles for the garbage collector per tensor and save (about 40 us of CPU each, 1,024 tensors of 16 KiB)."""

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> tuple[Any, list[str]]:
        if self.extensions:
            return super().transform_save_stream(write_item, raw_stream)
        return _NoCloseStream(raw_stream), []


class _CommitMixin:
    """Adds checksums, per-rank sidecars, retries and the manifest commit to a DCP writer."""

    def _init_commit(self, manifest_fields: Mapping[str, Any], storage_url: str,
                     storage_options: Optional[Mapping[str, Any]], retries: int, backoff_s: float) -> None:
        self.fs = _HashingFileSystem(self.fs)
        self.transforms = _ItemTransforms(self.transforms.extensions)
        self._manifest_fields = dict(manifest_fields)
        self._storage_url = storage_url
        self._storage_options = dict(storage_options or {})
        self._retries = retries
        self._backoff_s = backoff_s
        self._signing_key: Optional[bytes] = None
        self._nice = 0
        self._origin_pid = os.getpid()

    def write_data(self, plan: Any, planner: Any) -> Any:
        prefix = plan.storage_data.prefix
        if os.getpid() != self._origin_pid:  # the background process: its CPU goes to training first
            renice_threads(self._nice)
        sums: dict[str, fp.Entry] = {}
        fp_error: list[BaseException] = []
        remote = self.fs.remote
        if remote is not None:  # the byte writer process sums what it writes
            jobs = _fingerprint_jobs(plan, planner)
            fp_thread = None
        else:
            fp_thread, self.fs.staged_crcs = _start_fingerprint(plan, planner, sums, fp_error)
        if self.fs.direct:
            self.fs.align = BLOCK if aligns([_item_bytes(item) for item in plan.items]) else 0

        def write_all() -> Any:
            for name in [n for n in self.fs.records if n.startswith(prefix)]:
                del self.fs.records[name]
            self.fs.last_error = None
            if remote is not None:
                _begin_remote(plan, planner, jobs, remote)
            try:
                fut = super(_CommitMixin, self).write_data(plan, planner)  # type: ignore[misc]
                fut.wait()
            except Exception as e:
                cause, self.fs.last_error = self.fs.last_error, None
                if cause is not None and cause is not e:
                    raise cause from e
                raise
            if len(fut.value()) != len(plan.items):
                short = OSError(errno.EIO, f"only {len(fut.value())} of {len(plan.items)} items were written")
                cause, self.fs.last_error = self.fs.last_error, None
                if cause is not None:  # a writer thread of DCP's died of it: the storage's own error
                    raise cause
                raise short
            return fut

        try:
            fut = with_retries(write_all, f"writing the shards of rank prefix {prefix}", self._retries,
                               self._backoff_s)
        finally:
            if fp_thread is not None:
                fp_thread.join()
            self.fs.staged_crcs = None
        if fp_error:
            raise fp_error[0]
        if remote is not None:
            sums.update(_remote_fingerprint(jobs, remote))
        self._write_sidecar(prefix, sums, fut.value())
        return fut

    def _write_sidecar(self, prefix: str, sums: dict, results: list) -> None:
        """This rank's sidecar (its files, items' checksums and fingerprint share), once its data is durable."""
        part = Sidecar(
            prefix=prefix,
            files={name: rec for name, rec in self.fs.records.items() if name.startswith(prefix)},
            fingerprint=sums,
            items=self._item_checksums(results),
            item_sha256=self._item_sha256(results) if self.fs.item_sha256 else {},
            checkpoint_id=self._manifest_fields["checkpoint_id"],
            step=self._manifest_fields["step"],
        ).to_json()

        def write_part() -> None:
            with self.fs.create_stream(self.fs.concat_path(self.path, sidecar_name(prefix)), "wb") as stream:
                stream.write(part)
                if self.sync_files:
                    with contextlib.suppress(AttributeError, io.UnsupportedOperation):
                        os.fsync(stream.fileno())

        with_retries(write_part, f"writing {sidecar_name(prefix)}", self._retries, self._backoff_s)

    def _item_checksums(self, results: list) -> dict[ItemKey, int]:
        """The CRC32C of every item this rank wrote, from the segments its streams recorded."""
        out: dict[ItemKey, int] = {}
        for result in results:
            info = result.storage_data
            name = os.path.basename(str(info.relative_path))
            segments = {offset: (length, crc) for offset, length, crc in self.fs.segments.get(name, ())}
            seg = segments.get(info.offset)
            if seg is None or seg[0] != info.length:
                raise RuntimeError(
                    f"cannot attribute a checksum to {name} bytes {info.offset}+{info.length}: this torch "
                    "version writes DCP items in a way ckpt does not know; please report it")
            out[(name, info.offset, info.length)] = seg[1]
        return out

    def _item_sha256(self, results: list) -> dict[ItemKey, str]:
        """The SHA-256 of every item this rank wrote (signed saves), from the segments its streams recorded."""
        out: dict[ItemKey, str] = {}
        for result in results:
            info = result.storage_data
            name = os.path.basename(str(info.relative_path))
            out[(name, info.offset, info.length)] = self.fs.segment_sha256[name][info.offset]
        return out

    def finish(self, metadata: Metadata, results: list) -> None:
        fs, root = get_fs(self._storage_url, **self._storage_options)
        files: dict[str, FileEntry] = {}
        digests: dict[str, str] = {}
        parts = []
        names = [sidecar_name(f"__{i}_") for i in range(len(results))]
        for name, raw in zip(names, read_many(fs, [join(root, n) for n in names])):
            if not isinstance(raw, bytes):
                raise OSError(errno.EIO, f"{join(self._storage_url, name)} could not be read back before the "
                                         f"commit: {raw!r}")
            try:
                side = parse_sidecar(raw, name)
            except SidecarError as e:
                raise OSError(errno.EIO, f"{name} was written unreadable: {e}") from None
            if side.checkpoint_id != self._manifest_fields["checkpoint_id"]:
                raise OSError(errno.EIO, f"{name} belongs to another save ({side.checkpoint_id}); two jobs may be "
                                         f"writing step {self._manifest_fields['step']} under one root")
            files[name] = FileEntry(len(raw), crc32c.crc32c(raw))
            digests[name] = sha256_hex(raw)
            files.update({f: FileEntry(size, crc) for f, (size, crc) in side.files.items()})
            parts.append(side.fingerprint)
        with_retries(lambda: super(_CommitMixin, self).finish(metadata, results),  # type: ignore[misc]
                     "writing .metadata", self._retries, self._backoff_s)
        size, crc = self.fs.records[f"{DCP_METADATA_NAME}.tmp"]
        files[DCP_METADATA_NAME] = FileEntry(size, crc)
        digests[DCP_METADATA_NAME] = self.fs.digests[f"{DCP_METADATA_NAME}.tmp"]
        key = self._signing_key
        manifest = build_manifest(
            files=files,
            fingerprint=fp.combine(parts),
            world_size=len(results),
            digests=digests if key is not None else None,
            **self._manifest_fields,
        )
        body = manifest.to_json(signing_key=key).encode()
        with_retries(lambda: write_bytes_durable(fs, join(root, MANIFEST_NAME), body),
                     "writing manifest.json", self._retries, self._backoff_s)


class LocalCommitWriter(_CommitMixin, FileSystemWriter):
    """``FileSystemWriter`` (plain files, fsync) with checksums and the manifest commit."""

    def __init__(self, path: str, manifest_fields: Mapping[str, Any], retries: int = 3,
                 backoff_s: float = 0.5, **kwargs: Any) -> None:
        FileSystemWriter.__init__(self, path, **kwargs)
        self._init_commit(manifest_fields, path, None, retries, backoff_s)


class FsspecCommitWriter(_CommitMixin, FsspecWriter):
    """``FsspecWriter`` (any fsspec URL) with checksums and the manifest commit."""

    def __init__(self, path: str, manifest_fields: Mapping[str, Any], storage_options: Optional[Mapping[str, Any]] = None,
                 retries: int = 3, backoff_s: float = 0.5, **kwargs: Any) -> None:
        FsspecWriter.__init__(self, path, **kwargs, **dict(storage_options or {}))
        self._init_commit(manifest_fields, path, storage_options, retries, backoff_s)


def make_writer(path: str, manifest_fields: Mapping[str, Any], storage_options: Optional[Mapping[str, Any]] = None,
                signing_key: Optional[bytes] = None, nice: int = 0, direct_io: bool = True, **kwargs: Any) -> Any:
    """The right commit writer for ``path``: plain files locally, fsspec otherwise; with ``signing_key``, signing.

    ``nice``: run at least at this nice value when writing in another process
    than the one that made the writer (DCP's background process).
    ``direct_io``: local data files bypass the page cache (``direct_io.py``).
    """
    fs, _ = get_fs(path, **dict(storage_options or {}))
    if is_local(fs):
        writer = LocalCommitWriter(_local_path(path), manifest_fields, **kwargs)
        writer.fs.direct, writer.fs.sync = direct_io, writer.sync_files
    else:
        kwargs.setdefault("sync_files", False)
        writer = FsspecCommitWriter(path, manifest_fields, storage_options, **kwargs)
    writer._signing_key = signing_key
    writer._nice = nice
    writer.fs.item_sha256 = signing_key is not None
    return writer


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


ITEM_BUFFER_LIMIT = 64 << 20
"""Of the items DCP's own path reads (those ``inplace_read`` leaves to it), the ones up to this size are
read from remote storage once, into memory, and checked there; larger ones (and every one on local disk,
where the second read comes from the page cache) are checked by a chunked pass before DCP reads them."""


class _SafeReaderMixin:
    """``.metadata`` through the allowlist unpickler; with a verifier, every item checked against its write-time
    checksum (as it is read into its target, or before DCP's own path reads it)."""

    verifier: Optional[CheckpointVerifier] = None
    direct_io = False
    """Whether large regions are read with ``O_DIRECT`` (local files; ``make_reader``)."""
    _buffer_items = False
    _metadata: Optional[Metadata] = None
    load_metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata, read and checked once per reader (restore reads it before ``dcp.load`` does)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        metadata = self._metadata if rank is None else None
        if metadata is None:
            path = self._get_metadata_path(rank)
            if self.verifier is not None and rank is None:
                data = self.verifier.checked_bytes(DCP_METADATA_NAME)
            else:
                with self.fs.create_stream(path, "rb") as f:
                    data = f.read()
            metadata = load_dcp_metadata(data, str(path))
            if rank is None:
                self._metadata = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.load_metadata = metadata  # the saved chunks' shapes and dtypes, for inplace_read
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]

    def read_data(self, plan: Any, planner: Any) -> Any:
        # Tensor items go straight into their targets, files in parallel, each item read once and checked
        # whole by the verifier (inplace_read); DCP reads the rest, checked in _slice_file.
        return super().read_data(read_in_place(self, plan, planner), planner)  # type: ignore[misc]

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        verifier = self.verifier
        if verifier is None:
            return super()._slice_file(file, sinfo)  # type: ignore[misc]
        name = os.path.basename(str(sinfo.relative_path))
        if self._buffer_items and sinfo.length <= ITEM_BUFFER_LIMIT and verifier.manifest.version >= 2:
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            verifier.verify_bytes(name, sinfo.offset, sinfo.length, data)
            return io.BytesIO(data)
        verifier.verify_item(file, name, sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)  # type: ignore[misc]


class SafeLocalReader(_SafeReaderMixin, FileSystemReader):
    pass


class SafeFsspecReader(_SafeReaderMixin, FsspecReader):
    _buffer_items = True


def make_reader(path: str, storage_options: Optional[Mapping[str, Any]] = None,
                manifest: Optional[Manifest] = None, direct_io: bool = True) -> Any:
    """A safe DCP reader for checkpoint ``path``; with its ``manifest``, one that verifies what it reads.

    ``direct_io``: on a local file system, large regions are read with ``O_DIRECT`` (``inplace_read``).
    """
    opts = dict(storage_options or {})
    fs, dir_path = get_fs(path, **opts)
    if is_local(fs):
        reader: Any = SafeLocalReader(_local_path(path))
        reader.direct_io = direct_io
    else:
        reader = SafeFsspecReader(path, **opts)
    if manifest is not None:
        reader.verifier = verifier_for(path, manifest, opts)
    return reader


def verifier_for(path: str, manifest: Manifest, storage_options: Optional[Mapping[str, Any]] = None,
                 ) -> CheckpointVerifier:
    """A ``CheckpointVerifier`` reading the small files of checkpoint ``path`` through fsspec."""
    fs, dir_path = get_fs(path, **dict(storage_options or {}))
    return CheckpointVerifier(manifest, lambda name: fs.cat_file(join(dir_path, name)), path,
                              read_many=lambda names: read_many(fs, [join(dir_path, n) for n in names]))


def read_metadata(path: str, storage_options: Optional[Mapping[str, Any]] = None,
                  manifest: Optional[Manifest] = None) -> Metadata:
    """DCP metadata of a checkpoint directory, read with the allowlist unpickler (checked against ``manifest``)."""
    return make_reader(path, storage_options, manifest).read_metadata()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values load with ``weights_only=True`` and DTensor shards are
    placed once per layout (``planner.placed_for_load``)."""

    def create_local_plan(self) -> Any:
        state_dict = self.state_dict
        placed = placed_for_load(state_dict)
        if not placed:
            return super().create_local_plan()
        substituted = {**state_dict, **placed}  # DCP's own checks and read items, over the places made here
        self.state_dict = substituted
        try:
            return super().create_local_plan()
        finally:
            if self.state_dict is substituted:  # else DCP switched to a checkpoint's older key format (its own)
                self.state_dict = state_dict

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
