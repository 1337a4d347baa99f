"""The commit marker: ``manifest.json``, its schema, parsing and validation.

Pure data: building, serialising and checking a manifest never touches
storage or ``torch.distributed``.
"""

from __future__ import annotations

import json
import math
import platform
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from .signing import canonical
from .strict_json import MAX_INT, Fields, as_float, as_int, is_safe_name, loads_object

FORMAT_NAME = "ckpt_core.manifest"
FORMAT_VERSION = 2
"""1: the first format. 2: adds ``checkpoint_id``, which every rank's sidecar repeats (with per-item checksums).
Signed manifests (``signing``) are format 2 with two optional fields, ``digests`` and ``signature``."""
MAX_WORLD_SIZE = 2**31 - 1
CHECKPOINT_ID_RE = re.compile(r"^[0-9a-f]{8,64}(-[0-9]{1,19})?$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_NOT_WRITTEN = ("signed_content", "authenticated")


class ManifestError(ValueError):
    """A manifest that cannot be used: unparseable, wrong schema, or too new."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32c: Optional[int] = None


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    files: Mapping[str, FileEntry]
    fingerprint: Mapping[str, tuple[float, float, int]] = field(default_factory=dict)
    epoch: Optional[int] = None
    wall_time: float = 0.0
    permanent: bool = False
    healthy: bool = True
    metrics: Mapping[str, float] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    contents: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_id: Optional[str] = None
    version: int = FORMAT_VERSION
    digests: Mapping[str, str] = field(default_factory=dict)
    """SHA-256 (hex) of every sidecar and of ``.metadata``; written by signed saves only."""
    signature: Optional[str] = None
    """HMAC-SHA256 (hex) over the rest of the manifest (``signing.canonical``); None: unsigned."""
    signed_content: bytes = field(default=b"", repr=False, compare=False)
    """What ``signature`` signs, as read (set by ``parse_manifest``; never written)."""
    authenticated: bool = field(default=False, repr=False, compare=False)
    """Whether ``signing.authenticate`` checked the signature against the key (never written)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self, signing_key: Optional[bytes] = None) -> str:
        """The manifest as JSON; with ``signing_key``, with its ``signature`` (any signature it had is dropped)."""
        body = asdict(self)
        for k in _NOT_WRITTEN:
            del body[k]
        body["format"] = FORMAT_NAME
        body["files"] = {k: asdict(v) for k, v in sorted(self.files.items())}
        body["fingerprint"] = {k: list(v) for k, v in sorted(self.fingerprint.items())}
        body.pop("signature")
        if not body["digests"]:
            del body["digests"]
        text = json.dumps(body, indent=1, sort_keys=True, allow_nan=True)
        if signing_key is None:
            return text
        from .signing import signed_json

        return signed_json(text, signing_key)


def is_healthy(fingerprint: Mapping[str, tuple[float, float, int]]) -> bool:
    """A state is healthy when every tensor sum is finite (no NaN/Inf anywhere)."""
    return all(math.isfinite(s) and math.isfinite(a) for s, a, _ in fingerprint.values())


def new_checkpoint_id(run_id: Optional[str], step: int) -> str:
    """A checkpoint's identity: the run's random id and the step (a fresh random id without a run id)."""
    return f"{run_id or uuid.uuid4().hex}-{step}"


def library_versions() -> dict[str, str]:
    import torch

    from . import __version__

    return {"torch": torch.__version__, "ckpt": __version__, "python": platform.python_version()}


def build_manifest(
    *,
    step: int,
    world_size: int,
    files: Mapping[str, FileEntry],
    fingerprint: Mapping[str, tuple[float, float, int]],
    epoch: Optional[int] = None,
    permanent: bool = False,
    metrics: Optional[Mapping[str, float]] = None,
    contents: Optional[Mapping[str, Any]] = None,
    wall_time: Optional[float] = None,
    checkpoint_id: Optional[str] = None,
    digests: Optional[Mapping[str, str]] = None,
) -> Manifest:
    return Manifest(
        step=step,
        world_size=world_size,
        files=dict(files),
        fingerprint=dict(fingerprint),
        epoch=epoch,
        wall_time=time.time() if wall_time is None else wall_time,
        permanent=permanent,
        healthy=is_healthy(fingerprint),
        metrics={k: float(v) for k, v in (metrics or {}).items()},
        versions=library_versions(),
        contents=dict(contents or {}),
        checkpoint_id=checkpoint_id or new_checkpoint_id(None, step),
        digests=dict(digests or {}),
    )


def parse_manifest(text: str | bytes) -> Manifest:
    """Parse and validate a manifest: a valid ``Manifest`` or ``ManifestError`` saying what is wrong, for any input."""
    body = loads_object(text, "manifest", ManifestError)
    f = Fields(body, "manifest", ManifestError)
    if body.get("format") != FORMAT_NAME:
        raise ManifestError(f"manifest has no 'format': {FORMAT_NAME!r} field")
    version = f.int("version", minimum=1, maximum=MAX_INT)
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"manifest version {version} is newer than this library understands "
            f"({FORMAT_VERSION}); upgrade ckpt to read it"
        )
    signature = f.str("signature", SHA256_RE, default=None)
    return Manifest(
        step=f.int("step"),
        world_size=f.int("world_size", minimum=1, maximum=MAX_WORLD_SIZE),
        files=_files(f),
        fingerprint=_fingerprint(f),
        epoch=f.int("epoch", default=None),
        wall_time=f.float("wall_time", minimum=0.0, default=0.0),
        permanent=f.bool("permanent", default=False),
        healthy=f.bool("healthy", default=True),
        metrics=_metrics(f),
        versions=_versions(f),
        contents=f.object("contents", default={}),
        checkpoint_id=f.str("checkpoint_id", CHECKPOINT_ID_RE) if version >= 2 else None,
        version=version,
        digests=_digests(f),
        signature=signature,
        signed_content=b"" if signature is None else _signed_content(body),
    )


def _signed_content(body: dict) -> bytes:
    try:
        return canonical(body)
    except (RecursionError, ValueError, TypeError) as e:
        raise ManifestError(f"manifest cannot be checked against its signature ({type(e).__name__})") from None


def _digests(f: Fields) -> dict[str, str]:
    out = {}
    for name, value in f.object("digests", default={}).items():
        if not is_safe_name(name):
            raise f.fail("digests", f"names a file outside the checkpoint directory or with odd characters: {name!r}")
        if not isinstance(value, str) or not SHA256_RE.match(value):
            raise f.fail("digests", f"entry {name[:80]!r} must be a SHA-256 in hex")
        out[name] = value
    return out


def _files(f: Fields) -> dict[str, FileEntry]:
    out = {}
    for name, entry in f.object("files").items():
        if not is_safe_name(name):
            raise f.fail("files", f"names a file outside the checkpoint directory or with odd characters: {name!r}")
        e = Fields(entry if isinstance(entry, dict) else {}, f"manifest file entry {name!r}", ManifestError)
        if not isinstance(entry, dict):
            raise e.fail("size", "is missing (the entry is not an object)")
        out[name] = FileEntry(e.int("size"), e.int("crc32c", maximum=2**32 - 1, default=None))
    if not out:
        raise f.fail("files", "lists no files")
    return out


def _fingerprint(f: Fields) -> dict[str, tuple[float, float, int]]:
    out = {}
    for key, value in f.object("fingerprint", default={}).items():
        def fail(why: str, key: str = key) -> ManifestError:
            return f.fail("fingerprint", f"entry {key[:80]!r} {why}")

        if not isinstance(value, list) or len(value) != 3:
            raise fail("must be [sum, sum of absolute values, count]")
        out[key] = (as_float(value[0], fail, finite=False), as_float(value[1], fail, finite=False),
                    as_int(value[2], fail))
    return out


def _metrics(f: Fields) -> dict[str, float]:
    out = {}
    for key, value in f.object("metrics", default={}).items():
        out[key] = as_float(value, lambda why, key=key: f.fail("metrics", f"entry {key[:80]!r} {why}"), finite=False)
    return out


def _versions(f: Fields) -> dict[str, str]:
    versions = f.object("versions", default={})
    bad = [k for k, v in versions.items() if not isinstance(v, str)]
    if bad:
        raise f.fail("versions", f"entry {bad[0][:80]!r} must be a string")
    return dict(versions)
