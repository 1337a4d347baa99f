"""Storage edge: fsspec file systems, step directory names, durable small writes.

Everything that touches storage for our own files (manifests, listings,
deletions) goes through here; DCP's shards go through ``dcp_io``.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import time
from typing import Any, Optional

import fsspec
from fsspec.core import url_to_fs

STEP_PREFIX = "step_"
_CHECKPOINT_DIR_RE = re.compile(r"(?:step|checkpoint)_([0-9]{1,19})", re.ASCII)
"""Directory names that discovery lists under a root: ``step_<N>`` (ours) and ``checkpoint_<N>`` (Accelerate's
automatic naming), ASCII digits only. The number is a label; a checkpoint's step comes from its manifest."""
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"


def get_fs(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the fsspec file system for ``url`` and the path inside it."""
    if str(url).startswith("faulty://"):
        from . import faults  # noqa: F401  (registers the fault-injection protocol)
    fs, path = url_to_fs(os.fspath(url), **storage_options)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def join(base: str, *names: str) -> str:
    """Join path parts with ``/`` (valid for local paths and every fsspec URL)."""
    out = base.rstrip("/")
    for name in names:
        out = f"{out}/{name.strip('/')}"
    return out


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:09d}"


def parse_step_dirname(name: str) -> Optional[int]:
    """The number in a ``step_<N>``/``checkpoint_<N>`` directory name (ASCII digits), or None for anything else."""
    m = _CHECKPOINT_DIR_RE.fullmatch(basename(name))  # not match(...$): "$" also matches before a final newline
    return int(m.group(1)) if m else None


def write_bytes_durable(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file so that it is either absent or complete.

    Local disk: a temporary file in the same directory, fsync, atomic rename,
    fsync of the directory. Object stores: a single PUT, which is atomic.
    """
    if is_local(fs):
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), 0o644)
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    else:
        fs.pipe_file(path, data)


def read_many(fs: fsspec.AbstractFileSystem, paths: list[str]) -> list[Any]:
    """The bytes of each of ``paths`` (concurrently on object stores), or the exception reading it raised."""
    if not paths:
        return []
    try:
        found = fs.cat(list(paths), on_error="return")
    except FileNotFoundError as e:
        return [e] * len(paths)
    out = []
    for p in paths:
        value = found.get(p, found.get(fs._strip_protocol(p)))
        out.append(value if value is not None else FileNotFoundError(p))
    return out


def list_dir(fs: fsspec.AbstractFileSystem, path: str) -> list[dict]:
    """``fs.ls(path, detail=True)`` that bypasses listing caches (s3fs keeps one)."""
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache(path)
    try:
        return fs.ls(path, detail=True)
    except FileNotFoundError:
        return []


def remove_tree(fs: fsspec.AbstractFileSystem, path: str, attempts: int = 5, backoff_s: float = 0.2) -> None:
    """Delete a checkpoint directory, manifest first so a crash leaves it uncommitted, and nothing behind.

    The manifest delete is always sent (never skipped on a cached listing that
    misses it). A bulk delete on an object store can answer success while some
    keys failed (S3's per-key errors, e.g. ``SlowDown`` under throttling), which
    s3fs does not raise: what is still listed is deleted again, up to
    ``attempts`` rounds, then ``OSError`` names what stays.
    """
    try:
        fs.rm_file(join(path, MANIFEST_NAME))
    except FileNotFoundError:
        pass
    if fs.exists(path):
        fs.rm(path, recursive=True)
    left = _files_under(fs, path)
    for attempt in range(1, attempts):
        if not left:
            return
        time.sleep(backoff_s * 2 ** (attempt - 1))
        fs.rm(left)
        left = _files_under(fs, path)
    if left:
        raise OSError(errno.EIO, f"{len(left)} file(s) under {path} could not be deleted, e.g. {left[0]}")


def _files_under(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Every file under ``path`` as storage lists it now (no listing cache)."""
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache(path)
    try:
        return sorted(fs.find(path))
    except FileNotFoundError:
        return []
