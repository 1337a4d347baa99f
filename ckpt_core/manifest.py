"""The commit marker: ``manifest.json``, its schema, parsing and validation.

Pure data: building, serialising and checking a manifest never touches
storage or ``torch.distributed``.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

FORMAT_NAME = "ckpt_core.manifest"
FORMAT_VERSION = 1


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
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        body = asdict(self)
        body["format"] = FORMAT_NAME
        body["files"] = {k: asdict(v) for k, v in sorted(self.files.items())}
        body["fingerprint"] = {k: list(v) for k, v in sorted(self.fingerprint.items())}
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=True)


def is_healthy(fingerprint: Mapping[str, tuple[float, float, int]]) -> bool:
    """A state is healthy when every tensor sum is finite (no NaN/Inf anywhere)."""
    return all(math.isfinite(s) and math.isfinite(a) for s, a, _ in fingerprint.values())


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
    )


def parse_manifest(text: str | bytes) -> Manifest:
    """Parse and validate a manifest; raise ``ManifestError`` saying what is wrong."""
    try:
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise ManifestError(f"manifest has no 'format': {FORMAT_NAME!r} field")
    version = body.get("version")
    if not isinstance(version, int):
        raise ManifestError("manifest has no integer 'version'")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"manifest version {version} is newer than this library understands "
            f"({FORMAT_VERSION}); upgrade ckpt to read it"
        )
    try:
        files = {
            str(name): FileEntry(int(e["size"]), None if e.get("crc32c") is None else int(e["crc32c"]))
            for name, e in body["files"].items()
        }
        fingerprint = {
            str(k): (float(v[0]), float(v[1]), int(v[2])) for k, v in body.get("fingerprint", {}).items()
        }
        return Manifest(
            step=int(body["step"]),
            world_size=int(body["world_size"]),
            files=files,
            fingerprint=fingerprint,
            epoch=None if body.get("epoch") is None else int(body["epoch"]),
            wall_time=float(body.get("wall_time", 0.0)),
            permanent=bool(body.get("permanent", False)),
            healthy=bool(body.get("healthy", True)),
            metrics={str(k): float(v) for k, v in body.get("metrics", {}).items()},
            versions={str(k): str(v) for k, v in body.get("versions", {}).items()},
            contents=dict(body.get("contents", {})),
            version=version,
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ManifestError(f"manifest does not follow the schema ({type(e).__name__}: {e})") from None
