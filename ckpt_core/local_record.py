"""The local tier's commit record (``step_<N>.json``): its fields, and parsing it from untrusted bytes.

Torch-free, so that ``ckpt ls`` reads records without importing torch; the
local tier (``local_snapshot``) and the listing (``local_listing``) share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from .strict_json import MAX_INT, Fields, as_float, as_int, loads_object

FORMAT = "ckpt-local-snapshot"
VERSION = 1
ALIGN = 64
RECORD_RE = re.compile(r"step_([0-9]{1,19})\.json", re.ASCII)
HOST_RE = re.compile(r"[A-Za-z0-9._-]{0,253}\Z", re.ASCII)
"""A host name as a record may carry it (shown by ``ckpt ls``: no control characters, bounded)."""
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
"""The dtypes a snapshot may hold (torch's names without ``torch.``) and their sizes."""

Entry = tuple[float, float, int]


class SnapshotError(ValueError):
    """A snapshot's files are missing, malformed, or do not match their record or this run's state."""


def default_local_dir() -> str:
    return f"/dev/shm/ckpt-{os.getuid()}"


def job_key(run_id: str) -> str:
    """The directory name of one job's snapshots: another job never reads them."""
    return "job-" + hashlib.sha256(run_id.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TensorEntry:
    leaf: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    fingerprint: Entry = (0.0, 0.0, 0)


@dataclass(frozen=True)
class SnapshotRecord:
    """A parsed ``step_<N>.json``."""

    job: str
    owner: int
    world_size: int
    step: int
    epoch: int
    slot: int
    data_bytes: int
    data_crc32c: int
    small_bytes: int
    extra_bytes: int
    extra_crc32c: int
    treespec: str
    tensors: tuple[TensorEntry, ...]
    wall_time: float
    holder: int = -1
    """The rank that committed this copy (the owner, or the rank keeping a replica); -1: not recorded."""
    node_size: int = 0
    """Ranks per node of the run that wrote it (which node keeps which copy); 0: not recorded."""
    factor: int = 0
    """Its replication factor; 0: not recorded."""
    host: str = ""
    """The host name of the holder (what ``ckpt ls`` shows)."""

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "version": VERSION, **{k: getattr(self, k) for k in (
            "job", "owner", "world_size", "step", "epoch", "slot", "data_bytes", "data_crc32c", "small_bytes",
            "extra_bytes", "extra_crc32c", "treespec", "wall_time", "holder", "node_size", "factor", "host")},
            "tensors": [[t.leaf, t.dtype, list(t.shape), t.offset, t.nbytes, list(t.fingerprint)]
                        for t in self.tensors]}
        return json.dumps(body, separators=(",", ":")).encode()

def parse_record(text: bytes, what: str) -> SnapshotRecord:
    """A record from untrusted bytes; ``SnapshotError`` naming the field on anything malformed."""
    body = loads_object(text, what, SnapshotError)
    f = Fields(body, what, SnapshotError)
    if f.str("format") != FORMAT or f.int("version") != VERSION:
        raise SnapshotError(f"{what} is not a version-{VERSION} {FORMAT} record")
    raw = body.get("tensors")
    if not isinstance(raw, list):
        raise f.fail("tensors", "must be a list")
    data_bytes = f.int("data_bytes")
    tensors = tuple(_entry(t, f"{what}: tensor {i}", data_bytes) for i, t in enumerate(raw))
    rec = SnapshotRecord(
        f.str("job"), f.int("owner"), f.int("world_size", minimum=1), f.int("step"), f.int("epoch"), f.int("slot"),
        data_bytes, f.int("data_crc32c", maximum=2**32 - 1), f.int("small_bytes"), f.int("extra_bytes"),
        f.int("extra_crc32c", maximum=2**32 - 1), f.str("treespec"), tensors, f.float("wall_time"),
        f.int("holder", minimum=-1, default=-1), f.int("node_size", default=0), f.int("factor", default=0),
        f.str("host", HOST_RE, default=""))
    if rec.owner >= rec.world_size or rec.small_bytes > rec.extra_bytes or rec.holder >= rec.world_size:
        raise SnapshotError(f"{what}: owner {rec.owner} / holder {rec.holder} / small_bytes {rec.small_bytes} "
                            "out of range")
    return rec


def _entry(raw: Any, what: str, data_bytes: int) -> TensorEntry:
    def fail(why: str) -> SnapshotError:
        return SnapshotError(f"{what} {why}")

    if not isinstance(raw, list) or len(raw) != 6:
        raise fail("must be [leaf, dtype, shape, offset, nbytes, fingerprint]")
    leaf, dtype, shape, offset, nbytes, fprint = raw
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise fail(f"has an unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or len(shape) > 64 or not isinstance(fprint, list) or len(fprint) != 3:
        raise fail("has a malformed shape or fingerprint")
    dims = tuple(as_int(d, fail) for d in shape)
    offset, nbytes = as_int(offset, fail), as_int(nbytes, fail)
    numel = 1
    for d in dims:
        numel = min(numel * d, MAX_INT)
    if numel * ITEMSIZE[dtype] != nbytes or offset % ALIGN or offset + nbytes > data_bytes:
        raise fail(f"does not fit: shape {dims} of {dtype} is not {nbytes} bytes at offset {offset} of {data_bytes}")
    entry = (as_float(fprint[0], fail, finite=False), as_float(fprint[1], fail, finite=False), as_int(fprint[2], fail))
    return TensorEntry(as_int(leaf, fail), dtype, dims, offset, nbytes, entry)
