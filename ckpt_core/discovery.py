"""Discover and validate checkpoints under a root (storage edge) and choose one (pure)."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import crc32c

from .manifest import Manifest, ManifestError, parse_manifest
from .records import CheckpointRecord
from .storage import MANIFEST_NAME, basename, get_fs, join, list_dir, parse_step_dirname

log = logging.getLogger("ckpt_core")

VERIFY_LEVELS = ("none", "size", "checksum")


def read_manifest(fs, path: str) -> Manifest:
    """The manifest of checkpoint directory ``path``; FileNotFoundError when uncommitted."""
    return parse_manifest(fs.cat_file(join(path, MANIFEST_NAME)))


def record_from(path: str, step: int, manifest: Optional[Manifest], problem: Optional[str] = None) -> CheckpointRecord:
    if manifest is None:
        return CheckpointRecord(step=step, path=path, committed=False, problem=problem)
    return CheckpointRecord(
        step=step,
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
    )


def list_records(root: str, storage_options: Optional[dict] = None) -> list[CheckpointRecord]:
    """Every ``step_<N>`` directory under ``root``, oldest first, committed or not."""
    fs, root_path = get_fs(root, **(storage_options or {}))
    records = []
    for entry in list_dir(fs, root_path):
        if entry.get("type") != "directory":
            continue
        step = parse_step_dirname(entry["name"])
        if step is None:
            continue
        path = join(root.rstrip("/"), basename(entry["name"]))
        try:
            manifest = read_manifest(fs, join(root_path, basename(entry["name"])))
            records.append(record_from(path, step, manifest))
        except FileNotFoundError:
            records.append(record_from(path, step, None, "no manifest.json (in progress or torn)"))
        except ManifestError as e:
            records.append(record_from(path, step, None, f"unusable manifest.json: {e}"))
    return sorted(records, key=lambda r: r.step)


def validate(
    path: str,
    manifest: Manifest,
    level: str = "size",
    storage_options: Optional[dict] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Optional[str]:
    """Why checkpoint ``path`` is not loadable, or None when it checks out at ``level``.

    ``size`` compares every file's size with the manifest (one listing);
    ``checksum`` also reads every file and compares its CRC32C.
    """
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {level!r}")
    if level == "none":
        return None
    fs, dir_path = get_fs(path, **(storage_options or {}))
    present = {basename(e["name"]): int(e.get("size") or 0) for e in list_dir(fs, dir_path)}
    for name, entry in sorted(manifest.files.items()):
        if name not in present:
            return f"{name} is missing"
        if present[name] != entry.size:
            return f"{name} has {present[name]} bytes, the manifest says {entry.size}"
    if level == "checksum":
        for name, entry in sorted(manifest.files.items()):
            crc = 0
            with fs.open(join(dir_path, name), "rb") as f:
                while chunk := f.read(8 << 20):
                    crc = crc32c.crc32c(chunk, crc)
                    if progress is not None:
                        progress(len(chunk))
            if entry.crc32c is not None and crc != entry.crc32c:
                return f"{name} fails its checksum (crc32c {crc:#010x}, the manifest says {entry.crc32c:#010x})"
    return None


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
        return [r for r in committed if r.step == step]
    return sorted((r for r in committed if r.healthy), key=lambda r: r.step, reverse=True)
