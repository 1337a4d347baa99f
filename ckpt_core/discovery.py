"""Discover and validate checkpoints under a root (storage edge) and choose one (pure)."""

from __future__ import annotations

import hashlib
import logging
from pickle import UnpicklingError
from typing import Any, Callable, Optional, Sequence

import crc32c

from .crc_combine import crc32c_combine
from .integrity import CheckpointVerifier, IntegrityError, crc_of_range
from .manifest import Manifest, ManifestError, parse_manifest
from .records import CheckpointRecord
from .storage import DCP_METADATA_NAME, MANIFEST_NAME, basename, get_fs, join, list_dir, parse_step_dirname

log = logging.getLogger("ckpt_core")

VERIFY_LEVELS = ("none", "size", "checksum")


def read_manifest(fs, path: str) -> Manifest:
    """The manifest of checkpoint directory ``path``; FileNotFoundError when uncommitted."""
    return parse_manifest(fs.cat_file(join(path, MANIFEST_NAME)))


def record_from(path: str, step: int, manifest: Optional[Manifest], problem: Optional[str] = None,
                label: Optional[int] = None, unreadable: bool = False) -> CheckpointRecord:
    if manifest is None:
        return CheckpointRecord(step=step, path=path, committed=False, problem=problem, label=label,
                                unreadable=unreadable)
    return CheckpointRecord(
        step=manifest.step,
        path=path,
        committed=True,
        permanent=manifest.permanent,
        healthy=manifest.healthy,
        wall_time=manifest.wall_time,
        metrics=dict(manifest.metrics),
        world_size=manifest.world_size,
        epoch=manifest.epoch,
        total_bytes=manifest.total_bytes,
        num_files=len(manifest.files),
        checkpoint_id=manifest.checkpoint_id,
        label=label,
    )


def record_at(fs, path: str, fs_path: str, label: Optional[int] = None) -> CheckpointRecord:
    """The record of the checkpoint directory at ``path`` (``fs_path`` inside ``fs``), whatever its name."""
    step = label if label is not None else -1
    try:
        return record_from(path, step, read_manifest(fs, fs_path), label=label)
    except FileNotFoundError:
        return record_from(path, step, None, "no manifest.json (in progress or torn)", label)
    except ManifestError as e:
        return record_from(path, step, None, f"unusable manifest.json: {e}", label)
    except OSError as e:  # unknown, not absent: never taken for a torn save
        return record_from(path, step, None, f"manifest.json cannot be read: {type(e).__name__}: {e}", label,
                           unreadable=True)


def list_records(root: str, storage_options: Optional[dict] = None) -> list[CheckpointRecord]:
    """Every checkpoint directory under ``root`` (``step_<N>``, ``checkpoint_<N>``), oldest first, committed or not.

    The one discovery rule that ``ckpt ls``, retention, ``ckpt prune`` and
    restore share. A committed checkpoint's step is its manifest's.
    """
    fs, root_path = get_fs(root, **(storage_options or {}))
    records = []
    for entry in list_dir(fs, root_path):
        label = parse_step_dirname(entry["name"])
        if label is None or entry.get("type") != "directory":
            continue
        name = basename(entry["name"])
        records.append(record_at(fs, join(root.rstrip("/"), name), join(root_path, name), label))
    return sorted(records, key=lambda r: (r.step, r.path))


def validate(
    path: str,
    manifest: Manifest,
    level: str = "size",
    storage_options: Optional[dict] = None,
    progress: Optional[Callable[[int], None]] = None,
    unpickle_metadata: bool = True,
) -> Optional[str]:
    """Why checkpoint ``path`` is not loadable, or None when it checks out at ``level``.

    ``size``: every file is present with its manifest size (one listing);
    ``.metadata`` and every rank's sidecar match their checksums, the sidecars
    name this checkpoint's id and step, and ``.metadata`` unpickles under the
    allowlist (skipped with ``unpickle_metadata=False``, for a caller that
    unpickles it next anyway). ``checksum`` also reads every byte of every
    file: whole-file CRC32Cs, and each DCP item against the checksum its writer
    recorded. Loading checks each item it reads at any level but ``none``.
    """
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {level!r}")
    if level == "none":
        return None
    fs, dir_path = get_fs(path, **(storage_options or {}))
    present = {basename(e["name"]): e.get("size") for e in list_dir(fs, dir_path)}
    for name, entry in sorted(manifest.files.items()):
        if name not in present:
            return f"{name} is missing"
        if present[name] is not None and int(present[name]) != entry.size:
            return f"{name} has {present[name]} bytes, the manifest says {entry.size}"
    from .dcp_io import verifier_for

    verifier = verifier_for(path, manifest, storage_options)
    try:
        _check_structure(verifier, unpickle_metadata)
        if level == "checksum":
            _check_every_byte(fs, dir_path, verifier, progress)
    except (IntegrityError, UnpicklingError, OSError) as e:
        return str(e) if isinstance(e, IntegrityError) else f"{type(e).__name__}: {e}"
    return None


def _check_structure(verifier: CheckpointVerifier, unpickle_metadata: bool) -> None:
    from .safe_pickle import load_dcp_metadata

    verifier.sidecars()
    data = verifier.checked_bytes(DCP_METADATA_NAME)
    if unpickle_metadata:
        load_dcp_metadata(data, f"{verifier.where}/{DCP_METADATA_NAME}")


def _check_every_byte(fs, dir_path: str, verifier: CheckpointVerifier,
                      progress: Optional[Callable[[int], None]]) -> None:
    """One pass over every file: each item against its own checksum, each file against the manifest's.

    Between two items a data file may hold fewer than ``PADDING_MAX`` zero bytes (block
    alignment, ``dcp_io._save_config``); any other byte outside the recorded items fails the check.
    """
    manifest = verifier.manifest
    items: dict[str, list[tuple[int, int]]] = {}
    for side in verifier.sidecars():
        for name, offset, length in side.items:
            items.setdefault(name, []).append((offset, length))
    for name, entry in sorted(manifest.files.items()):
        ranges = sorted(items.get(name, ())) or [(0, entry.size)]
        with fs.open(join(dir_path, name), "rb") as f:
            crc, end = 0, 0
            for offset, length in ranges:
                if offset != end:
                    crc, end = _padding(f, name, crc, end, offset)
                sha = hashlib.sha256() if manifest.authenticated and name in items else None
                part = crc_of_range(f, offset, length, progress, sha=sha)
                if name in items and part != verifier.expected_item_crc(name, offset, length):
                    raise IntegrityError(f"{name} bytes {offset}..{offset + length} fail their checksum")
                if sha is not None:
                    verifier.check_item_sha256(name, offset, length, sha.hexdigest())
                crc, end = crc32c_combine(crc, part, length), offset + length
        if end != entry.size:
            raise IntegrityError(f"{name} bytes {end}..{entry.size} belong to no item its writer recorded")
        if entry.crc32c is not None and crc != entry.crc32c:
            raise IntegrityError(f"{name} fails its checksum (crc32c {crc:#010x}, the manifest says "
                                 f"{entry.crc32c:#010x})")


PADDING_MAX = 4096
"""Zero bytes a writer may leave between items of a data file: less than one block (``direct_io.BLOCK``)."""


def _padding(f: Any, name: str, crc: int, end: int, offset: int) -> tuple[int, int]:
    """Check bytes ``end..offset`` of file ``f`` as padding between items: the file's CRC32C so far with them
    appended, and ``offset``; ``IntegrityError`` if they are not fewer than ``PADDING_MAX`` zeros."""
    if not 0 < offset - end < PADDING_MAX:
        raise IntegrityError(f"{name} bytes {end}..{offset} belong to no item its writer recorded")
    f.seek(end)
    gap = f.read(offset - end)
    if len(gap) != offset - end or gap.count(0) != len(gap):
        raise IntegrityError(f"{name} bytes {end}..{offset} belong to no item its writer recorded and are not "
                             "the zeros that align the items")
    return crc32c_combine(crc, crc32c.crc32c(gap), len(gap)), offset


def choose_for_restore(
    records: Sequence[CheckpointRecord], step: Optional[int] = None
) -> list[CheckpointRecord]:
    """Candidates to restore, best first (pure).

    Without ``step``: committed, healthy checkpoints, newest first (unhealthy
    ones, saved with non-finite state, are never chosen automatically). With
    ``step``: that checkpoint alone if committed (an explicit rollback may pick
    an unhealthy one), else nothing.
    """
    committed = [r for r in records if r.committed]
    if step is not None:
        return sorted((r for r in committed if r.step == step), key=_preference)
    return sorted((r for r in committed if r.healthy), key=lambda r: (-r.step, _preference(r)))


def _preference(r: CheckpointRecord) -> tuple:
    """Among checkpoints of one step, the one whose directory is named for its step first, then by path."""
    return (r.label != r.step, r.path)
