"""Read DCP tensor items straight into the tensors they load into: every byte once, files in parallel.

DCP's ``FileSystemReader.read_data`` reads one file after the other and
``torch.load``\\ s every tensor item into a new tensor that it then
``copy_``\\ s into the load target. Here a thread pool reads the files side by
side, a large file in parts (runs of whole items) of its own (reads and
CRC32C release the GIL; the first touch of the load buffers in one thread
overlaps the reads of the others), and each item in one pass, front to back,
in reads of up to ``READ_CHUNK`` bytes:

* items up to ``WHOLE_ITEM`` bytes are read whole into memory, checked, then
  parsed and copied into their targets;
* of a larger item, the first ``ENVELOPE`` bytes are read first: the zip
  local header of its storage record there (not its pickle) says where the
  storage bytes start; with the saved chunk's shape and dtype from
  ``.metadata``, that gives where each target's region lies, and the pass
  goes on front to back, those bytes with ``readinto`` straight into the
  target's own memory, the rest through a scratch buffer (the item's last
  ``ENVELOPE`` bytes are kept in memory);
* with a verifier, the CRC32C (and for a signed manifest the SHA-256) of each
  read is computed right after it, while it is in cache, and the item's is
  checked against the one recorded at write time: every byte of the item,
  not only the part applied;
* only then is the item's pickle read (``torch.load`` with
  ``map_location="meta"``, from the checked bytes in memory: dtype, shape,
  strides, where the storage lies); if it disagrees with where the bytes
  were put, the item goes to DCP's path, which reads it again.

On a local file system (``direct_io``, the default) the large reads bypass
the page cache with ``O_DIRECT``. A save written with ``O_DIRECT`` starts
each large tensor's bytes at a block boundary of its file
(``dcp_io._save_config``) and a restore into fresh buffers loads into
block-aligned ones (``aligned_empty_like``), so the whole blocks of a region
are read straight into the target in 64 MiB reads, their CRC32C taken on the
target right after each read; only a region's first and last partial blocks
pass through the thread's page-aligned 4 MiB buffer. Regions of files written packed (an
older version, buffered writes) or targets not aligned like their file go
through that buffer, checked there and copied into the target. A buffered
read of a cold file costs a page-cache page per 4 KiB and a kernel copy
into the target (docs/benchmarks.md, "The read path against the disk").
Where the file system refuses ``O_DIRECT`` the reads stay buffered.

A failed check fails the load, naming the file. The bytes of a corrupt item
may be in its load target by then: a restore into the live tensors falls
back to a checkpoint that overwrites them, or leaves them marked as partly
overwritten (``overwritten``); exports and ``restore_in_place=False`` load
into fresh buffers and drop them. Items this does not handle (byte items,
items with stream transforms, targets that are not contiguous CPU tensors,
saved tensors that are not contiguous or have another dtype or byte order,
regions that are not one contiguous byte range, archives that do not parse)
are left to DCP's own path, where the reader's ``_slice_file`` checks each
before it is read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import io
import math
import os
import struct
import sys
import threading
from typing import Any, Callable, Iterator, Optional

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .direct_io import BLOCK, give_buffer, open_direct_read, take_buffer
from .direct_io import READ_CHUNK as DIRECT_CHUNK

READ_CHUNK = 16 << 20
"""Bytes per read: large for the storage, small enough that its CRC32C runs on bytes still in cache."""
STRAIGHT_CHUNK = 64 << 20
"""Bytes per direct read straight into a target (``_read_straight``): the device writes them to memory, not
to the cache, so only the size of the read matters."""
ENVELOPE = 64 << 10
"""Bytes of each end of a large item kept in memory: its zip records and pickle lie there (at least 4 KiB:
torch's zip reader reads the last 4 KiB of an archive)."""
WHOLE_ITEM = 1 << 20
"""Items up to this size are read whole, in one read (on object stores: up to ``SCRATCH``, one request)."""
SCRATCH = 4 << 20
"""Bytes of the buffer (per item, when needed) that item bytes no target takes pass through to be checked."""
READ_THREADS = 8
"""Reads side by side at most: the files, and parts of a file when there are fewer files than threads."""
DIRECT_MIN = 1 << 20
"""Regions of at least this many bytes are read directly (``O_DIRECT``) where the file system allows it."""
PIECE = 16 << 20
"""Bytes of a region read before the load's early fingerprint (``EarlySums``) hears of them: the sums left
when the reads end are at most one piece per reading thread."""
PART_MIN = 64 << 20
"""A file is cut into parts (runs of whole items, each read by its own thread) of at least this many bytes."""
Spans = list[tuple[int, memoryview]]
"""Bytes of an item in memory: (offset in the item, bytes)."""


def aligned_empty_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t)`` whose bytes start at a block boundary (contiguous CPU tensors of at least
    ``DIRECT_MIN`` bytes; others as ``empty_like`` makes them, DTensors with such a local shard included).

    Direct reads fill such a buffer without a copy from an aligned save (``_read_direct``); the cost is up to
    one block of address space per tensor, never touched.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = aligned_empty_like(t.to_local())
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < DIRECT_MIN or t.is_quantized \
            or t.layout != torch.strided:
        return torch.empty_like(t)
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
    skip = -raw.data_ptr() % BLOCK
    return raw[skip : skip + nbytes].view(t.dtype).as_strided(t.shape, t.stride())


@dataclasses.dataclass
class _Target:
    """One read request: the region of a load target that one item fills."""

    req: ReadItem
    tensor: torch.Tensor
    guess: Optional[int]
    """Where the region's bytes start in the saved storage, if the saved chunk is the contiguous tensor that
    ``.metadata`` describes (confirmed from the item's pickle once the item is checked)."""
    start: int = 0
    """Where the region's bytes start in the item."""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclasses.dataclass
class _Item:
    """One DCP item (a ``torch.save`` archive at ``offset`` in file ``name``) and the targets it fills."""

    name: str
    offset: int
    length: int
    targets: list[_Target]


def read_in_place(reader: Any, plan: LoadPlan, planner: LoadPlanner) -> LoadPlan:
    """Read the tensor items of ``plan`` that can go straight into their targets; return the plan of the rest.

    ``reader`` is a DCP ``FileSystemReader`` (or ``FsspecReader``) after
    ``set_up_storage_reader``: its ``fs``, ``path`` and ``storage_data`` are
    used as ``read_data`` uses them, its ``load_metadata`` (else the
    planner's ``metadata``) gives the saved chunks' shapes, and its
    ``verifier`` (if any) checks every item read here. A local reader whose
    ``direct_io`` is set reads large regions with ``O_DIRECT``.
    """
    rest, files = _plan(reader, plan, planner)
    verifier = getattr(reader, "verifier", None)
    whole = SCRATCH if getattr(reader, "_buffer_items", False) else WHOLE_ITEM  # object stores: fewer requests
    direct = bool(getattr(reader, "direct_io", False))
    stop = threading.Event()
    sums = getattr(reader, "early_sums", None)
    if sums is not None:
        sums.expect(req.dest_index.fqn for req in plan.items)

    def one_part(job: tuple[str, list[_Item]]) -> tuple[list[_Target], list[ReadItem]]:
        path = reader.fs.concat_path(reader.path, job[0])
        with _open_source(reader.fs.create_stream(path, "rb"), os.fspath(path) if direct else None) as source:
            return _read_file(source, job[1], verifier, whole, stop, sums)

    for done, left in _run_all(one_part, _parts(files), stop):
        for target in done:
            planner.commit_tensor(target.req, target.tensor)
        rest.extend(left)
    return dataclasses.replace(plan, items=rest)


def _plan(reader: Any, plan: LoadPlan, planner: LoadPlanner) -> tuple[list[ReadItem], dict[str, list[_Item]]]:
    """The requests left to DCP, and the items to read here grouped by file (each file's in offset order)."""
    metadata = getattr(reader, "load_metadata", None) or getattr(planner, "metadata", None)
    rest: list[ReadItem] = []
    items: dict[tuple[str, int, int], _Item] = {}
    for req in plan.items:
        sinfo = reader.storage_data[req.storage_index]
        target = None
        if req.type == LoadItemType.TENSOR and not sinfo.transform_descriptors:
            target = planner.resolve_tensor(req).detach()
        if target is None or target.device.type != "cpu" or not target.is_contiguous() \
                or tuple(target.shape) != tuple(req.lengths):
            rest.append(req)
            continue
        key = (str(sinfo.relative_path), sinfo.offset, sinfo.length)
        item = items.setdefault(key, _Item(os.path.basename(key[0]), sinfo.offset, sinfo.length, []))
        item.targets.append(_Target(req, target, _guess(metadata, req, target)))
    files: dict[str, list[_Item]] = {}
    for (relative_path, _, _), item in sorted(items.items()):
        files.setdefault(relative_path, []).append(item)
    return rest, files


def _guess(metadata: Any, req: ReadItem, target: torch.Tensor) -> Optional[int]:
    """Where the bytes of ``req``'s region start in the storage of the saved chunk, if that chunk is a
    contiguous tensor of the shape and dtype ``metadata`` gives it (None: unknown, or not one byte range)."""
    md = None if metadata is None else metadata.state_dict_metadata.get(req.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != target.dtype:
        return None
    want = tuple(req.storage_index.offset or ())
    hint = req.storage_index.index
    chunks = md.chunks[hint : hint + 1] if hint is not None and 0 <= hint < len(md.chunks) else []
    chunk = next((c for c in [*chunks, *md.chunks] if tuple(c.offsets) == want), None)
    if chunk is None:
        return None
    shape, starts, lengths = tuple(chunk.sizes), tuple(req.storage_offsets), tuple(req.lengths)
    if len(starts) != len(shape) or any(s + n > d for s, n, d in zip(starts, lengths, shape)):
        return None
    if not _one_range(shape, lengths):
        return None
    stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return sum(s * st for s, st in zip(starts, stride)) * target.element_size()


def _parts(files: dict[str, list[_Item]]) -> list[tuple[str, list[_Item]]]:
    """The reads to run side by side, in file order: each file's items, cut into runs of about the total
    over ``READ_THREADS`` bytes (and at least ``PART_MIN``): each run ends where it comes closest to that
    size, so that runs of equal items are equal (the slowest run sets the load's time).

    Each run is read front to back by one thread: the disk sees up to ``READ_THREADS`` sequential streams,
    and the first touch of the load buffers (page faults) in one thread overlaps the reads of the others.
    """
    total = sum(item.length for items in files.values() for item in items)
    size = max(PART_MIN, total // READ_THREADS)
    parts: list[tuple[str, list[_Item]]] = []
    for path, items in files.items():
        run: list[_Item] = []
        run_bytes = 0
        for item in items:
            if run and run_bytes + item.length - size > size - run_bytes:  # closer to the size without it
                parts.append((path, run))
                run, run_bytes = [], 0
            run.append(item)
            run_bytes += item.length
        if run:
            parts.append((path, run))
    return parts


def _run_all(fn: Callable[[Any], Any], jobs: list, stop: threading.Event) -> list:
    """``fn`` over ``jobs`` on up to ``READ_THREADS`` threads; the first job's error (in job order) is raised.

    After an error ``stop`` is set, so the other jobs end early.
    """
    if len(jobs) <= 1:
        return [fn(job) for job in jobs]

    def guarded(job: Any) -> Any:
        try:
            return fn(job)
        except BaseException:
            stop.set()
            raise

    with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(jobs)), "ckpt-read") as pool:
        futures = [pool.submit(guarded, job) for job in jobs]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if not errors:
        return [f.result() for f in futures]
    err = next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
    del futures, errors  # the raised error's traceback holds this frame: no cycle through its locals
    try:
        raise err
    finally:
        err = None


class _Stopped(Exception):
    """Another file's read failed; this one stopped early."""


class _Short(Exception):
    """The file ends inside the item, or a parse needs bytes that are not in memory."""


class _Source:
    """An open data file: its buffered stream and, where direct reads are on and allowed, an ``O_DIRECT``
    descriptor of the same file with a page-aligned buffer for it."""

    def __init__(self, stream: Any, fd: Optional[int]) -> None:
        self.stream, self.fd = stream, fd
        self._buf: Any = None

    def seek(self, pos: int) -> int:
        return self.stream.seek(pos)

    def readinto(self, buf: memoryview) -> int:
        return self.stream.readinto(buf)

    def read(self, n: int = -1) -> bytes:
        return self.stream.read(n)

    def fileno(self) -> int:
        return self.stream.fileno()

    def buffer(self) -> np.ndarray:
        """The direct reads' buffer (``DIRECT_CHUNK`` bytes, page-aligned, taken on first use)."""
        if self._buf is None:
            self._buf = take_buffer(DIRECT_CHUNK)
        return np.frombuffer(self._buf, dtype=np.uint8)

    def drop_direct(self) -> None:
        """Read buffered from now on (the file system refused a direct read)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        if self._buf is not None:
            give_buffer(self._buf)
            self._buf = None
        self.drop_direct()


@contextlib.contextmanager
def _open_source(stream_cm: Any, direct_path: Optional[str]) -> Iterator[_Source]:
    """A ``_Source`` over the stream ``stream_cm`` opens, with an ``O_DIRECT`` descriptor of ``direct_path``
    (None: buffered reads only; also where the file system refuses ``O_DIRECT``)."""
    with stream_cm as stream:
        source = _Source(stream, None if direct_path is None else open_direct_read(direct_path))
        try:
            if source.fd is None:  # with direct reads, a larger read-ahead would read their bytes twice
                _advise_sequential(stream)
            yield source
        finally:
            source.close()


def _read_file(source: _Source, items: list[_Item], verifier: Any, whole: int,
               stop: threading.Event, sums: Any = None) -> tuple[list[_Target], list[ReadItem]]:
    """Read a run of items of one file (those up to ``whole`` bytes in one read); returns the targets filled
    and the requests left to DCP. Each item filled and checked is reported to ``sums`` (``EarlySums``)."""
    done: list[_Target] = []
    left: list[ReadItem] = []
    for item in items:
        if stop.is_set():
            raise _Stopped()
        if _read_item(source, item, verifier, whole, stop, sums):
            done.extend(item.targets)
            if sums is not None:
                sums.filled((t.req.dest_index.fqn, t.tensor) for t in item.targets)
        else:
            left.extend(t.req for t in item.targets)
    return done, left


def _read_item(stream: Any, item: _Item, verifier: Any, whole: int, stop: threading.Event, sums: Any = None) -> bool:
    """Fill the targets of ``item`` and check it; False to leave it to DCP (whose path checks it first).
    ``sums`` (``EarlySums``) hears of each piece of a large item's regions as it lands."""
    if verifier is not None and verifier.manifest.version < 2:
        verifier.verify_item(stream, item.name, item.offset, item.length)  # no item checksums: the whole file, once
        verifier = None
    if verifier is not None:
        verifier.expected_item_crc(item.name, item.offset, item.length)  # an item its writer did not record: fail now
    digest = _Digest(verifier)
    try:
        if item.length <= max(whole, 2 * ENVELOPE):
            ok = _read_whole(item, _read_at(stream, item, 0, item.length), digest)
        else:
            ok = _read_large(stream, item, _read_at(stream, item, 0, ENVELOPE), digest, stop, sums)
    except _Short:
        return False  # the file ends inside the item: DCP's path reports it
    return ok


class _Digest:
    """The CRC32C (and, for a signed manifest, the SHA-256) of an item's bytes, fed in order."""

    def __init__(self, verifier: Any) -> None:
        self.verifier = verifier
        self.crc = 0
        self.sha = hashlib.sha256() if verifier is not None and verifier.manifest.authenticated else None

    def update(self, data: memoryview) -> None:
        if self.verifier is not None:
            self.crc = crc32c.crc32c(data, self.crc)
        if self.sha is not None:
            self.sha.update(data)

    def check(self, item: _Item) -> None:
        """Raise ``IntegrityError`` unless what was fed matches what the item's writer recorded."""
        if self.verifier is not None:
            self.verifier.check_item(item.name, item.offset, item.length, self.crc,
                                     None if self.sha is None else self.sha.hexdigest())


def _read_at(stream: Any, item: _Item, pos: int, n: int) -> memoryview:
    """Item bytes ``pos..pos+n`` in a new buffer."""
    stream.seek(item.offset + pos)
    out = memoryview(bytearray(n))
    if _read_into(stream, out) != n:
        raise _Short()
    return out


def _read_whole(item: _Item, data: memoryview, digest: _Digest) -> bool:
    """An item read whole: checked, then parsed, then copied into its targets."""
    digest.update(data)
    digest.check(item)
    if not _place(_Sparse(item.length, [(0, data)]), item.targets):
        return False
    for target in item.targets:
        dest = memoryview(target.tensor.reshape(-1).view(torch.uint8).numpy())
        dest[:] = data[target.start : target.start + target.nbytes]
    return True


def _place(view: _Sparse, targets: list[_Target]) -> bool:
    """Parse the (checked) archive in ``view``; set where each target's bytes start. False if the item is
    not one for this path."""
    try:
        layout = _layout(view)
    except Exception:  # noqa: BLE001 - a damaged or unexpected archive: DCP's path reports it
        return False
    if layout is None:
        return False
    for target in targets:
        first = _region_start(layout, target.req, target.tensor)
        if first is None:
            return False
        target.start = first
    return _disjoint(targets)


def _disjoint(targets: list[_Target]) -> bool:
    """Sort ``targets`` by where they start in the item; whether their byte ranges do not overlap."""
    targets.sort(key=lambda t: t.start)
    return all(a.start + a.nbytes <= b.start for a, b in zip(targets, targets[1:]))


def _read_large(stream: Any, item: _Item, head: memoryview, digest: _Digest, stop: threading.Event,
                sums: Any = None) -> bool:
    """A large item whose first bytes are ``head``: regions into their targets where the storage record's
    local header and ``.metadata`` say, checked, then confirmed from its pickle (False: they disagree, or it
    does not parse; DCP's path reads it)."""
    data_start = _data_start(head)
    if data_start is None or any(t.guess is None for t in item.targets):
        return False
    for target in item.targets:
        target.start = data_start + target.guess
    if not _disjoint(item.targets) or item.targets[-1].start + item.targets[-1].nbytes > item.length:
        return False
    checked = _fill(stream, item, [(0, head)], digest, stop, sums)
    digest.check(item)
    expected = {id(t): t.start for t in item.targets}
    return _place(_Sparse(item.length, checked), item.targets) and all(
        t.start == expected[id(t)] for t in item.targets)


def _data_start(head: memoryview) -> Optional[int]:
    """Where the storage bytes start in an archive whose first bytes are ``head``: after the first zip local
    header of a stored record named ``<archive>/data/<key>``. A guess from bytes not yet checked (a pickle
    may hold the same bytes); ``_read_large`` confirms it from the checked archive. Nothing is unpickled."""
    data = bytes(head)
    pos = data.find(b"PK\x03\x04")
    while pos != -1 and pos + 30 <= len(data):
        method, = struct.unpack_from("<H", data, pos + 8)
        name_len, extra_len = struct.unpack_from("<HH", data, pos + 26)
        name = data[pos + 30 : pos + 30 + name_len].split(b"/")
        start = pos + 30 + name_len + extra_len
        if method == 0 and len(name) >= 2 and name[-2] == b"data" and start <= len(data):
            return start
        pos = data.find(b"PK\x03\x04", pos + 4)
    return None


def _fill(stream: Any, item: _Item, head: Spans, digest: _Digest, stop: threading.Event, sums: Any = None) -> Spans:
    """Read ``item`` front to back: each target's region into the target (each ``PIECE`` reported to ``sums``
    as it lands), the rest from ``head`` or through a scratch buffer, every byte into ``digest``. Returns the
    bytes in memory that went into it: those of ``head`` and of the targets, and the item's last ``ENVELOPE``
    bytes."""
    checked: Spans = []
    scratch: list[memoryview] = []
    pos = 0
    for target in item.targets:
        _pass_over(stream, item, head, pos, target.start, digest, scratch, checked)
        dest = memoryview(target.tensor.reshape(-1).view(torch.uint8).numpy())
        step = PIECE if sums is not None else max(len(dest), 1)
        for at in range(0, len(dest), step):
            _read_range(stream, item, target.start + at, dest[at : at + step], digest, stop)
            if sums is not None:
                sums.read(target.req.dest_index.fqn, target.tensor, min(at + step, len(dest)))
        checked.append((target.start, dest))
        pos = target.start + target.nbytes
    _pass_over(stream, item, head, pos, item.length, digest, scratch, checked)
    return checked


def _pass_over(stream: Any, item: _Item, head: Spans, start: int, end: int, digest: _Digest,
               scratch: list[memoryview], checked: Spans) -> None:
    """Item bytes ``start..end`` that no target takes: into ``digest``, from ``head`` where they are there,
    else read through ``scratch``; those of ``head`` and of the item's last ``ENVELOPE`` bytes are kept in
    ``checked``."""
    for span_start, data in head:
        if span_start <= start < span_start + len(data):
            piece = data[start - span_start : min(end, span_start + len(data)) - span_start]
            digest.update(piece)
            checked.append((start, piece))
            start += len(piece)
    if start >= end:
        return
    keep = max(start, item.length - ENVELOPE) if end == item.length else end
    if keep > start:
        size = min(SCRATCH, READ_CHUNK, keep - start)
        if not scratch or len(scratch[0]) < size:
            scratch[:] = [memoryview(bytearray(size))]
        buf = scratch[0]
        for pos in range(start, keep, len(buf)):
            _read_range(stream, item, pos, buf[: min(len(buf), keep - pos)], digest, None)
    if keep < end:
        last = _read_at(stream, item, keep, end - keep)
        digest.update(last)
        checked.append((keep, last))


def _read_range(stream: Any, item: _Item, start: int, dest: memoryview, digest: _Digest,
                stop: Optional[threading.Event]) -> None:
    """Read item bytes ``start..start+len(dest)`` into ``dest`` in ``READ_CHUNK`` reads, each into ``digest``
    (directly, bypassing the page cache, where the source allows it and the range is large)."""
    if getattr(stream, "fd", None) is not None and len(dest) >= DIRECT_MIN:
        done = _read_direct(stream, item.offset + start, dest, digest, stop)
        if done == len(dest):
            return
        start, dest = start + done, dest[done:]  # the file system refused a direct read: buffered from here
    stream.seek(item.offset + start)
    for pos in range(0, len(dest), READ_CHUNK):
        if stop is not None and stop.is_set():
            raise _Stopped()
        chunk = dest[pos : pos + READ_CHUNK]
        if _read_into(stream, chunk) != len(chunk):
            raise _Short()
        digest.update(chunk)


def _read_direct(source: _Source, offset: int, dest: memoryview, digest: _Digest,
                 stop: Optional[threading.Event]) -> int:
    """Read file bytes ``offset..offset+len(dest)`` into ``dest`` with ``O_DIRECT``, each piece into ``digest``
    in order; the bytes done (fewer if the file system refused a direct read: the source reads buffered from
    then on). ``_Short`` at end of file.

    Where ``dest`` lies at the same offset from a block boundary as the file bytes (an aligned save read into
    aligned load buffers, ``aligned_empty_like``), the whole blocks go straight into ``dest``; the rest of it
    through the source's buffer.
    """
    head = -offset % BLOCK
    if (_address(dest) + head) % BLOCK or len(dest) < head + BLOCK:
        return _read_bounced(source, offset, dest, digest, stop)
    middle = head + (len(dest) - head) // BLOCK * BLOCK
    done = 0
    for start, end, read in ((0, head, _read_bounced), (head, middle, _read_straight),
                             (middle, len(dest), _read_bounced)):
        if start < end:
            n = read(source, offset + start, dest[start:end], digest, stop)
            done += n
            if n < end - start:
                break
    return done


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _read_straight(source: _Source, offset: int, dest: memoryview, digest: _Digest,
                   stop: Optional[threading.Event]) -> int:
    """``_read_direct`` of whole blocks at an aligned ``offset`` into an aligned ``dest``: no copy."""
    done = 0
    while done < len(dest):
        if stop is not None and stop.is_set():
            raise _Stopped()
        piece = dest[done : done + STRAIGHT_CHUNK]
        try:
            n = os.preadv(source.fd, [piece], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            source.drop_direct()
            return done
        if n <= 0:
            raise _Short()
        digest.update(piece[:n])
        done += n
        if n % BLOCK and done < len(dest):  # a partial block: the file ends here
            raise _Short()
    return done


def _read_bounced(source: _Source, offset: int, dest: memoryview, digest: _Digest,
                  stop: Optional[threading.Event]) -> int:
    """``_read_direct`` through the source's aligned buffer: whole blocks read there, each piece into
    ``digest`` there, then copied into ``dest``."""
    buf = source.buffer()
    out = np.frombuffer(dest, dtype=np.uint8)
    pos = offset - offset % BLOCK
    done = 0
    while done < len(dest):
        if stop is not None and stop.is_set():
            raise _Stopped()
        want = min(len(buf), -(-(offset + len(dest) - pos) // BLOCK) * BLOCK)
        try:
            n = os.preadv(source.fd, [buf[:want]], pos)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            source.drop_direct()
            return done
        skip = offset + done - pos
        take = min(n - skip, len(dest) - done)
        if take <= 0:
            raise _Short()
        piece = buf[skip : skip + take]
        digest.update(memoryview(piece))
        np.copyto(out[done : done + take], piece)  # numpy copies without the GIL
        done += take
        pos += n
        if n % BLOCK and done < len(dest):  # a partial block: the file ends here
            raise _Short()
    return done


def _read_into(stream: Any, buf: memoryview) -> int:
    """Fill ``buf`` from ``stream`` (several reads if the stream returns less); the bytes read."""
    got = 0
    while got < len(buf):
        n = stream.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


class _Sparse(io.RawIOBase):
    """A read-only file of ``length`` bytes made of the spans in memory; a read of other bytes raises
    ``_Short``."""

    def __init__(self, length: int, spans: Spans) -> None:
        super().__init__()
        self.length, self._spans, self._pos = length, spans, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: self.length + pos}[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: Optional[int] = -1) -> bytes:
        n = self.length - self._pos if n is None or n < 0 else min(n, self.length - self._pos)
        if n <= 0:
            return b""
        out = bytearray()
        while len(out) < n:
            pos = self._pos + len(out)
            span = next(((s, d) for s, d in self._spans if s <= pos < s + len(d)), None)
            if span is None:
                raise _Short()
            out += span[1][pos - span[0] : pos - span[0] + n - len(out)]
        self._pos += n
        return bytes(out)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        memoryview(b).cast("B")[: len(data)] = data
        return len(data)


@dataclasses.dataclass
class _Layout:
    """What the archive of one item says about its tensor."""

    saved: torch.Tensor
    """The saved tensor, on the meta device: dtype, shape, strides, storage offset."""
    data_start: int
    """Where the storage's bytes start in the item."""


def _layout(view: Any) -> Optional[_Layout]:
    """The layout of the archive in ``view``; None unless it holds one contiguous tensor in native byte order."""
    view.seek(0)
    saved = torch.load(view, map_location="meta", weights_only=True)
    offset, native = _archive_facts(view)
    if offset is None or not native or not isinstance(saved, torch.Tensor) or not saved.is_contiguous():
        return None
    return _Layout(saved, offset)


def _byte_range(view: Any, req: Any, target: torch.Tensor) -> Optional[int]:
    """Offset in the item's archive where the bytes of the region ``req`` reads start, or None."""
    layout = _layout(view)
    return None if layout is None else _region_start(layout, req, target)


def _region_start(layout: _Layout, req: Any, target: torch.Tensor) -> Optional[int]:
    """Offset in the item where the bytes of the region ``req`` reads into ``target`` start, or None."""
    saved = layout.saved
    if saved.dtype != target.dtype:
        return None
    shape, starts, lengths = tuple(saved.shape), tuple(req.storage_offsets), tuple(req.lengths)
    if len(starts) != len(shape) or any(s + n > d for s, n, d in zip(starts, lengths, shape)):
        return None
    if not _one_range(shape, lengths):
        return None
    first = (saved.storage_offset() + sum(s * st for s, st in zip(starts, saved.stride()))) * saved.element_size()
    if first + math.prod(lengths) * saved.element_size() > saved.untyped_storage().nbytes():
        return None  # the pickle's shape does not fit its storage: let torch.load report it
    return layout.data_start + first


def _one_range(shape: tuple, lengths: tuple) -> bool:
    """Whether a region of ``lengths`` in a contiguous tensor of ``shape`` is one contiguous byte range.

    It is when it has length 1 in every dimension before the last one it does
    not span whole (the later ones it spans whole): rows ``a..b`` of a matrix
    are, columns ``a..b`` of several rows are not.
    """
    partial = [i for i, (n, d) in enumerate(zip(lengths, shape)) if n != d]
    if not partial or math.prod(lengths) == 0:
        return True
    return all(n == 1 for n in lengths[: partial[-1]])


def _archive_facts(view: Any) -> tuple[Optional[int], bool]:
    """Where the archive's only storage record starts (None unless there is exactly one), and whether the
    archive's byte order is this machine's (``torch.load`` would swap the bytes otherwise)."""
    view.seek(0)
    zf = torch._C.PyTorchFileReader(view)
    records = zf.get_all_records()
    data = [r for r in records if r.startswith("data/")]
    order = [r for r in records if r == "byteorder" or r.endswith("/byteorder")]
    native = bytes(zf.get_record(order[0])).decode() == sys.byteorder if order else sys.byteorder == "little"
    return (zf.get_record_offset(data[0]) if len(data) == 1 else None), native


def _advise_sequential(stream: Any) -> None:
    """Tell the kernel a local file is read front to back (a larger read-ahead)."""
    with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation, ValueError):
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
