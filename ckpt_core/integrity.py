"""Checks that what is read from a checkpoint is exactly what its writer wrote.

A ``CheckpointVerifier`` is built from a checkpoint's manifest and a function
that reads one of its small files. It checks:

* small files (``.metadata``, sidecars) against their size and CRC32C in the
  manifest before they are parsed;
* each sidecar names the manifest's checkpoint id and step (a manifest copied
  from another checkpoint, or a sidecar from another one, is refused);
* each DCP item (file, offset, length) that a load reads against the CRC32C
  its writer computed while writing it: exactly the bytes that are applied,
  after any resharding. Manifests of version 1 have no per-item checksums; for
  them every file a load touches is checked whole, once;
* for a manifest whose signature was checked (``signing.authenticate``), each
  small file also against its SHA-256 in the signed manifest, so the item
  checksums in the sidecars are covered by the signature, and each DCP item
  also against the SHA-256 its (signed) writer recorded: a CRC32C is linear,
  so a forger can keep it while changing the bytes; a SHA-256 cannot be kept.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Optional

import crc32c

from .manifest import Manifest
from .sidecar import SIDECAR_SUFFIX, ItemKey, Sidecar, SidecarError, parse_sidecar, sidecar_for

CHUNK = 8 << 20


class IntegrityError(ValueError):
    """Bytes read from a checkpoint differ from what its writer recorded (corruption, tampering, a mixed-up copy)."""


def crc_of_range(f: Any, offset: int, length: int, progress: Optional[Callable[[int], None]] = None,
                 sha: Any = None) -> int:
    """CRC32C of ``length`` bytes of file object ``f`` from ``offset`` (chunked: no copy of the range).

    ``sha``: a ``hashlib`` object that is also fed the range.
    """
    f.seek(offset)
    crc, left = 0, length
    while left > 0:
        chunk = f.read(min(CHUNK, left))
        if not chunk:
            raise IntegrityError(f"the file ends {left} bytes before the end of the range {offset}+{length}")
        crc = crc32c.crc32c(chunk, crc)
        if sha is not None:
            sha.update(chunk)
        left -= len(chunk)
        if progress is not None:
            progress(len(chunk))
    return crc


class CheckpointVerifier:
    """Verifies the files and items of one checkpoint against its manifest (see the module docstring)."""

    def __init__(self, manifest: Manifest, read: Callable[[str], bytes], where: str,
                 read_many: Optional[Callable[[list[str]], list[Any]]] = None) -> None:
        self.manifest = manifest
        self._read = read
        self._read_many = read_many
        self._prefetched: dict[str, bytes] = {}
        self.where = where
        self._sidecars: dict[str, Sidecar] = {}
        self._whole_ok: set[str] = set()
        self._lock = threading.Lock()

    def checked_bytes(self, name: str) -> bytes:
        """The bytes of small file ``name``, after checking them against the manifest."""
        entry = self.manifest.files.get(name)
        if entry is None:
            raise IntegrityError(f"{self.where}/{name} is not listed in the manifest")
        data = self._prefetched.pop(name, None)
        if data is None:
            data = self._read(name)
        if len(data) != entry.size:
            raise IntegrityError(f"{self.where}/{name} has {len(data)} bytes, the manifest says {entry.size}")
        if entry.crc32c is not None and crc32c.crc32c(data) != entry.crc32c:
            raise IntegrityError(f"{self.where}/{name} fails its checksum (CRC32C {crc32c.crc32c(data):#010x}, "
                                 f"the manifest says {entry.crc32c:#010x})")
        if self.manifest.authenticated:
            self._check_digest(name, data)
        return data

    def _check_digest(self, name: str, data: bytes) -> None:
        from .signing import same_digest, sha256_hex

        expected = self.manifest.digests.get(name)
        if expected is None:
            raise IntegrityError(f"{self.where}/{name} has no SHA-256 in the signed manifest, so the signature "
                                 "does not cover it")
        if not same_digest(sha256_hex(data), expected):
            raise IntegrityError(f"{self.where}/{name} does not match its SHA-256 in the signed manifest "
                                 "(changed after signing)")

    def sidecar(self, name: str) -> Sidecar:
        """Sidecar ``name``, checked against the manifest and parsed; cached."""
        with self._lock:
            if name not in self._sidecars:
                try:
                    side = parse_sidecar(self.checked_bytes(name), f"{self.where}/{name}")
                except SidecarError as e:
                    raise IntegrityError(str(e)) from None
                self._check_identity(name, side)
                self._sidecars[name] = side
            return self._sidecars[name]

    def _check_identity(self, name: str, side: Sidecar) -> None:
        m = self.manifest
        if m.version < 2:
            return
        if side.checkpoint_id != m.checkpoint_id or side.step != m.step:
            raise IntegrityError(
                f"{self.where}/{name} belongs to checkpoint {side.checkpoint_id} (step {side.step}), the manifest "
                f"to {m.checkpoint_id} (step {m.step}): files of two checkpoints are mixed")
        for fname, (size, _crc) in side.files.items():
            entry = m.files.get(fname)
            if entry is None or entry.size != size:
                raise IntegrityError(f"{self.where}/{name} lists {fname} ({size} bytes), which the manifest "
                                     f"{'does not list' if entry is None else f'lists with {entry.size} bytes'}")

    def sidecars(self) -> list[Sidecar]:
        """Every sidecar the manifest lists (their names end with ``.ckptpart.json``), fetched together."""
        names = [n for n in sorted(self.manifest.files) if n.endswith(SIDECAR_SUFFIX)]
        missing = [n for n in names if n not in self._sidecars]
        if self._read_many is not None and len(missing) > 1:
            for name, data in zip(missing, self._read_many(missing)):
                if isinstance(data, bytes):
                    self._prefetched[name] = data
        return [self.sidecar(n) for n in names]

    def verify_item(self, f: Any, name: str, offset: int, length: int) -> None:
        """Check the bytes of one DCP item in open file ``f`` (``name`` inside the checkpoint)."""
        if self.manifest.version < 2:
            self._verify_whole(f, name)
            return
        self.expected_item_crc(name, offset, length)
        sha = hashlib.sha256() if self.manifest.authenticated else None
        actual = crc_of_range(f, offset, length, sha=sha)
        self.check_item(name, offset, length, actual, None if sha is None else sha.hexdigest())

    def verify_bytes(self, name: str, offset: int, length: int, data: bytes) -> None:
        """Check the bytes of one DCP item already read into memory."""
        expected = self.expected_item_crc(name, offset, length)
        if len(data) != length:
            raise IntegrityError(f"{self.where}/{name} bytes {offset}..{offset + length} fail their checksum "
                                 f"({len(data)} bytes, written as {expected:#010x})")
        sha = hashlib.sha256(data).hexdigest() if self.manifest.authenticated else None
        self.check_item(name, offset, length, crc32c.crc32c(data), sha)

    def check_item(self, name: str, offset: int, length: int, crc: int, sha256: Optional[str]) -> None:
        """Check one DCP item whose CRC32C (and SHA-256: required for a signed manifest) the caller computed
        over exactly its ``length`` bytes."""
        expected = self.expected_item_crc(name, offset, length)
        if crc != expected:
            raise IntegrityError(f"{self.where}/{name} bytes {offset}..{offset + length} fail their checksum "
                                 f"(CRC32C {crc:#010x}, written as {expected:#010x})")
        if self.manifest.authenticated:
            if sha256 is None:
                raise IntegrityError(f"{self.where}/{name} bytes {offset}..{offset + length} were read without "
                                     "their SHA-256, which the signed manifest requires")
            self.check_item_sha256(name, offset, length, sha256)

    def check_item_sha256(self, name: str, offset: int, length: int, actual: str) -> None:
        """For an authenticated manifest: the SHA-256 of one item against the one its signed writer recorded."""
        from .signing import same_digest

        side_name = sidecar_for(name) or ""
        expected = self.sidecar(side_name).item_sha256.get((name, offset, length))
        if expected is None:
            raise IntegrityError(f"{self.where}/{name} bytes {offset}..{offset + length} have no SHA-256 in "
                                 f"{side_name}, so the signature does not cover them")
        if not same_digest(actual, expected):
            raise IntegrityError(f"{self.where}/{name} bytes {offset}..{offset + length} do not match their SHA-256 "
                                 "in the signed checkpoint (changed after signing)")

    def expected_item_crc(self, name: str, offset: int, length: int) -> int:
        side_name = sidecar_for(name)
        if side_name is None or side_name not in self.manifest.files:
            raise IntegrityError(f"{self.where}/{name} is not covered by any sidecar the manifest lists")
        key: ItemKey = (name, offset, length)
        crc = self.sidecar(side_name).items.get(key)
        if crc is None:
            raise IntegrityError(f"{self.where}/{name} bytes {offset}..{offset + length} are not an item its "
                                 f"writer recorded ({side_name})")
        return crc

    def _verify_whole(self, f: Any, name: str) -> None:
        if name in self._whole_ok:
            return
        entry = self.manifest.files.get(name)
        if entry is None or entry.crc32c is None:
            raise IntegrityError(f"{self.where}/{name} has no checksum in the manifest")
        actual = crc_of_range(f, 0, entry.size)
        if actual != entry.crc32c:
            raise IntegrityError(f"{self.where}/{name} fails its checksum (CRC32C {actual:#010x}, the manifest "
                                 f"says {entry.crc32c:#010x})")
        self._whole_ok.add(name)

