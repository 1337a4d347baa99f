"""One rank's snapshot in the local tier: its own state, as files in node memory.

Unlike a durable checkpoint (DCP: one logical state, resharded on load), a
snapshot holds exactly what this rank holds (local shards of sharded
tensors, its RNG and data position) and is restored by the same rank at the
same world size. Files under ``<node dir>/rank_<owner>/``:

* ``slot_<k>.data``: the tensors' bytes, 64-byte aligned. The slot file is
  mapped into memory (``torch.UntypedStorage.from_file``, ``shared=True``):
  staging a snapshot is the copy into it, so no disk is written and nothing
  else is copied. ``keep + 1`` slots rotate (``local_layout.slot_to_reuse``).
* ``step_<N>.extra``: the non-tensor leaves and the rank's small state,
  serialised with ``torch.save`` and read back with ``weights_only=True``.
* ``step_<N>.json``: the commit record, written last (atomic rename): owner,
  world size, step, slot, the tensors' layout and fingerprint, the CRC32C of
  the data and of the extra bytes. A slot's record is removed before the slot
  is overwritten, so a record never describes bytes being rewritten.
"""

from __future__ import annotations

import io
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import crc32c
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps

from . import fingerprint as fp
from .state import RANK_KEY, TrainState, _empty_like_tree, _to_blob
from .local_record import (ALIGN, ITEMSIZE, RECORD_RE, SnapshotError, SnapshotRecord, TensorEntry,  # noqa: F401
                           parse_record)

_DTYPES = {name: getattr(torch, name) for name in ITEMSIZE}
log = logging.getLogger("ckpt_core")


@dataclass
class Capture:
    """What a snapshot stages: the tensor leaves (local shards) and everything else as bytes."""

    step: int
    epoch: int
    leaves: list[torch.Tensor]
    entries: list[TensorEntry]
    treespec: str
    small: bytes
    others: bytes

    @property
    def data_bytes(self) -> int:
        return _aligned(self.entries[-1].offset + self.entries[-1].nbytes) if self.entries else 0


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _plain(tree: Any) -> Any:
    """Mappings as dicts (an ``OrderedDict`` and the ``dict`` of a template flatten alike)."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_plain(v) for v in tree)
    return tree


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes_of(obj: Any) -> bytes:
    return _to_blob(obj).numpy().tobytes()


def capture(state: TrainState) -> Capture:
    """This rank's state, flattened: tensor leaves to stage, the rest serialised now (it is small)."""
    tree = _plain(state._model_optim())
    small = _bytes_of(state.small_state())
    leaves, spec = tree_flatten(tree)
    tensors, entries, others, offset = [], [], [], 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            local = _local(leaf).detach()
            nbytes = local.numel() * local.element_size()
            entries.append(TensorEntry(i, str(local.dtype).removeprefix("torch."), tuple(local.shape), offset, nbytes))
            tensors.append(local)
            offset = _aligned(offset + nbytes)
        else:
            others.append(leaf)
    return Capture(state.step, state.epoch, tensors, entries, treespec_dumps(spec), small, _bytes_of(others))


def view(data: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """The tensor ``e`` describes, as a view of the byte tensor ``data``."""
    dtype = _DTYPES[e.dtype]
    raw = data[e.offset:e.offset + e.nbytes]
    return raw.view(dtype).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=dtype)


def stage(cap: Capture, data: torch.Tensor) -> None:
    """Copy the captured tensors into ``data`` (a slot's mapped bytes): the only work on the training thread."""
    for t, e in zip(cap.leaves, cap.entries):
        if e.nbytes:
            view(data, e).copy_(t)
    cap.leaves = []  # the live tensors are not held past the copy


def seal(cap: Capture, data: torch.Tensor, job: str, owner: int, world_size: int, slot: int) -> SnapshotRecord:
    """Checksums and fingerprint of the staged bytes (in the background): the record to commit."""
    mv = memoryview(data.numpy())
    entries = tuple(TensorEntry(e.leaf, e.dtype, e.shape, e.offset, e.nbytes, fp.tensor_entry(view(data, e)))
                    for e in cap.entries)
    extra = cap.small + cap.others
    return SnapshotRecord(job, owner, world_size, cap.step, cap.epoch, slot, cap.data_bytes,
                          crc32c.crc32c(mv[:cap.data_bytes]), len(cap.small), len(extra), crc32c.crc32c(extra),
                          cap.treespec, entries, time.time())


# ------------------------------------------------------------------ files
def open_slot(path: str, nbytes: int) -> torch.Tensor:
    """The slot file at ``path`` (created or resized to ``nbytes``, space reserved) mapped as a byte tensor.

    Space is reserved with ``posix_fallocate``: a full ``/dev/shm`` is an error here, not a SIGBUS
    when the mapping is written.
    """
    size = max(nbytes, 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, 0)
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]


def write_atomic(path: str, body: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        mv = memoryview(body)
        while mv:
            mv = mv[os.write(fd, mv):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def commit(owner_dir: str, rec: SnapshotRecord, extra: bytes) -> None:
    """Write the extra bytes, then the record (last: its presence is the commit)."""
    write_atomic(os.path.join(owner_dir, f"step_{rec.step}.extra"), extra)
    write_atomic(os.path.join(owner_dir, f"step_{rec.step}.json"), rec.to_json())


def uncommit(owner_dir: str, step: int) -> None:
    """Remove the record of ``step`` first (the snapshot stops counting), then its extra bytes."""
    for name in (f"step_{step}.json", f"step_{step}.extra"):
        try:
            os.unlink(os.path.join(owner_dir, name))
        except FileNotFoundError:
            pass


def slot_path(owner_dir: str, slot: int) -> str:
    return os.path.join(owner_dir, f"slot_{slot}.data")


def list_records(owner_dir: str) -> dict[int, str]:
    """``step -> record path`` of the records in ``owner_dir`` (unparsed)."""
    try:
        names = os.listdir(owner_dir)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        m = RECORD_RE.fullmatch(name)
        if m:
            out[int(m.group(1))] = os.path.join(owner_dir, name)
    return out


def read_record(path: str) -> Optional[SnapshotRecord]:
    """The record at ``path``; None when it is gone or unusable (a warning names the file and why)."""
    try:
        with open(path, "rb") as f:
            return parse_record(f.read(), path)
    except FileNotFoundError:
        return None
    except (OSError, SnapshotError) as e:
        log.warning("ckpt_core: ignoring local snapshot record %s: %s", path, e)
        return None


def map_readonly(path: str, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the slot file at ``path`` as a byte tensor mapped copy-on-write (no copy is made:
    the pages stay node memory's). A file shorter than that is a ``SnapshotError``, never a SIGBUS."""
    size = os.stat(path).st_size
    if size < nbytes:
        raise SnapshotError(f"{path} holds {size} bytes; its record says {nbytes}")
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def check_bytes(rec: SnapshotRecord, data: torch.Tensor, extra: bytes, what: str) -> None:
    """The data and extra bytes are the ones the record was sealed over (CRC32C), else ``SnapshotError``."""
    if data.numel() != rec.data_bytes or len(extra) != rec.extra_bytes:
        raise SnapshotError(f"{what}: {data.numel()} data and {len(extra)} extra bytes, the record says "
                            f"{rec.data_bytes} and {rec.extra_bytes}")
    if crc32c.crc32c(memoryview(data.numpy())) != rec.data_crc32c:
        raise SnapshotError(f"{what}: the data fails its checksum (crc32c)")
    if crc32c.crc32c(extra) != rec.extra_crc32c:
        raise SnapshotError(f"{what}: the extra bytes fail their checksum (crc32c)")


# ------------------------------------------------------------------ restore
def rebuild(rec: SnapshotRecord, data: torch.Tensor, extra: bytes, state: TrainState) -> dict[str, Any]:
    """Fresh buffers (as ``TrainState.load_template`` builds) filled from a checked snapshot: ``model``/``optim``
    and this rank's small state under ``ranks.<owner>``. Nothing live is touched; ``SnapshotError`` when the
    snapshot does not fit this run's state or its fingerprint does not match."""
    template = _plain(_empty_like_tree(state._model_optim()))
    leaves, spec = tree_flatten(template)
    if treespec_dumps(spec) != rec.treespec:
        raise SnapshotError("the snapshot holds another state structure than this run's (other model or optimizer)")
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if slots != [e.leaf for e in rec.tensors]:
        raise SnapshotError("the snapshot's tensors are not where this run's state has tensors")
    others = _load_blob(extra[rec.small_bytes:], "the non-tensor state")
    if not isinstance(others, list) or len(others) != len(leaves) - len(slots):
        raise SnapshotError("the snapshot's non-tensor state does not fit this run's state")
    diffs = []
    for e in rec.tensors:
        target = _local(leaves[e.leaf])
        if str(target.dtype).removeprefix("torch.") != e.dtype or tuple(target.shape) != e.shape:
            raise SnapshotError(f"leaf {e.leaf}: the snapshot has {e.dtype}{list(e.shape)}, this run "
                                f"{target.dtype}{list(target.shape)}")
        src = view(data, e)
        diffs += fp.compare({str(e.leaf): e.fingerprint}, {str(e.leaf): fp.tensor_entry(src)})
        target.copy_(src)
    if diffs:
        raise SnapshotError("the snapshot's tensors do not match its fingerprint: " + "; ".join(diffs[:5]))
    it = iter(others)
    filled = [leaf if isinstance(leaf, torch.Tensor) else next(it) for leaf in leaves]
    out = tree_unflatten(filled, spec)
    out[RANK_KEY] = {str(rec.owner): torch.frombuffer(bytearray(extra[:rec.small_bytes]), dtype=torch.uint8)}
    return out


def _load_blob(b: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(b), weights_only=True)
    except Exception as e:  # noqa: BLE001 - undecodable: not this run's snapshot
        raise SnapshotError(f"{what} does not decode: {type(e).__name__}: {str(e)[:200]}") from None


def live_fingerprint(state: TrainState) -> dict[str, fp.Entry]:
    """Per-leaf fingerprint of the live state's local tensors (checked after a snapshot is applied)."""
    leaves, _ = tree_flatten(_plain(state._model_optim()))
    return {str(i): fp.tensor_entry(_local(leaf).detach())
            for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}


def expected_fingerprint(rec: SnapshotRecord) -> dict[str, fp.Entry]:
    return {str(e.leaf): e.fingerprint for e in rec.tensors}
