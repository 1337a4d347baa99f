"""Per-rank sidecars (``__<r>_.ckptpart.json``): the files a rank wrote and a CRC32C per DCP item.

Each rank writes its sidecar once its shards are durable; the coordinator
lists every sidecar in the manifest with its own size and checksum. A sidecar
repeats the checkpoint's id and step, so a manifest copied from another
checkpoint no longer matches. Pure data: building and parsing never touch
storage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .strict_json import Fields, as_int, is_safe_name, loads_object

SIDECAR_SUFFIX = ".ckptpart.json"
SIDECAR_FORMAT = "ckpt_core.part"
_PREFIX_RE = re.compile(r"^__[0-9]{1,10}_$")
_SHARD_RE = re.compile(r"^(__[0-9]{1,10}_)[0-9]{1,10}\.distcp$")

ItemKey = tuple[str, int, int]
"""(file name, offset, length) of one DCP write item, as DCP's metadata records it."""


class SidecarError(ValueError):
    """A sidecar that cannot be used: unparseable, wrong schema, or not this checkpoint's."""


def sidecar_name(rank_prefix: str) -> str:
    return f"{rank_prefix}{SIDECAR_SUFFIX}"


def sidecar_for(file_name: str) -> Optional[str]:
    """The sidecar that covers shard ``file_name`` (``__3_0.distcp`` -> ``__3_.ckptpart.json``), if any."""
    m = _SHARD_RE.match(file_name)
    return sidecar_name(m.group(1)) if m else None


@dataclass(frozen=True)
class Sidecar:
    prefix: str
    files: Mapping[str, tuple[int, int]]
    fingerprint: Mapping[str, tuple[float, float, int]]
    items: Mapping[ItemKey, int] = field(default_factory=dict)
    checkpoint_id: Optional[str] = None
    step: Optional[int] = None
    item_sha256: Mapping[ItemKey, str] = field(default_factory=dict)
    """SHA-256 (hex) of every item: written by signed saves only (the CRC32Cs alone can be forged)."""

    def to_json(self) -> bytes:
        items: dict[str, list[list[int]]] = {}
        for (name, offset, length), crc in sorted(self.items.items()):
            items.setdefault(name, []).append([offset, length, crc])
        body = {
            "format": SIDECAR_FORMAT, "checkpoint_id": self.checkpoint_id, "step": self.step,
            "prefix": self.prefix, "files": {k: list(v) for k, v in sorted(self.files.items())},
            "items": items, "fingerprint": {k: list(v) for k, v in sorted(self.fingerprint.items())},
        }
        if self.item_sha256:
            shas: dict[str, list[list]] = {}
            for (name, offset, length), sha in sorted(self.item_sha256.items()):
                shas.setdefault(name, []).append([offset, length, sha])
            body["item_sha256"] = shas
        return json.dumps(body, allow_nan=True).encode()


def parse_sidecar(text: str | bytes, name: str = "sidecar") -> Sidecar:
    """A valid ``Sidecar`` or ``SidecarError``, for any input (version 1 sidecars have no id and no items)."""
    from .manifest import CHECKPOINT_ID_RE, ManifestError, _fingerprint

    body = loads_object(text, name, SidecarError)
    f = Fields(body, name, SidecarError)
    prefix = f.str("prefix", _PREFIX_RE)
    files = {}
    for fname, entry in f.object("files").items():
        def fail(why: str, fname: str = fname) -> SidecarError:
            return f.fail("files", f"entry {fname[:80]!r} {why}")

        if not is_safe_name(fname) or not fname.startswith(prefix):
            raise fail(f"is not a file of rank prefix {prefix}")
        if not isinstance(entry, list) or len(entry) != 2:
            raise fail("must be [size, crc32c]")
        files[fname] = (as_int(entry[0], fail), as_int(entry[1], fail, maximum=2**32 - 1))
    try:
        fingerprint = _fingerprint(Fields(body, name, ManifestError))
    except ManifestError as e:
        raise SidecarError(str(e)) from None
    versioned = body.get("format") == SIDECAR_FORMAT
    items = _items(f, files) if versioned else {}
    return Sidecar(
        prefix=prefix, files=files, fingerprint=fingerprint,
        items=items,
        item_sha256=_item_sha256(f, items) if versioned else {},
        checkpoint_id=f.str("checkpoint_id", CHECKPOINT_ID_RE) if versioned else None,
        step=f.int("step") if versioned else None,
    )


def _items(f: Fields, files: Mapping[str, tuple[int, int]]) -> dict[ItemKey, int]:
    out: dict[ItemKey, int] = {}
    for fname, entries in f.object("items").items():
        def fail(why: str, fname: str = fname) -> SidecarError:
            return f.fail("items", f"of {fname[:80]!r} {why}")

        if fname not in files or not isinstance(entries, list):
            raise fail("must list [offset, length, crc32c] of a file the sidecar names")
        size = files[fname][0]
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 3:
                raise fail("must be [offset, length, crc32c]")
            offset, length = as_int(entry[0], fail, maximum=size), as_int(entry[1], fail, maximum=size)
            if offset + length > size:
                raise fail(f"has an item past the end of the file ({offset}+{length} > {size})")
            out[(fname, offset, length)] = as_int(entry[2], fail, maximum=2**32 - 1)
    return out


def _item_sha256(f: Fields, items: Mapping[ItemKey, int]) -> dict[ItemKey, str]:
    from .manifest import SHA256_RE

    out: dict[ItemKey, str] = {}
    for fname, entries in f.object("item_sha256", default={}).items():
        def fail(why: str, fname: str = fname) -> SidecarError:
            return f.fail("item_sha256", f"of {fname[:80]!r} {why}")

        if not isinstance(entries, list):
            raise fail("must list [offset, length, sha256]")
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[2], str) \
                    or not SHA256_RE.match(entry[2]):
                raise fail("must be [offset, length, sha256 in hex]")
            key = (fname, as_int(entry[0], fail), as_int(entry[1], fail))
            if key not in items:
                raise fail(f"names bytes {key[1]}+{key[2]}, which are not an item of the sidecar")
            out[key] = entry[2]
    return out
