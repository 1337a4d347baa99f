"""Checks on a checkpoint root before anything is saved or restored under it."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import fsspec

from .storage import get_fs, is_local


class CheckpointRootError(ValueError):
    """The checkpoint root cannot be used: an unknown protocol, a regular file, or not writable for a saving run."""


def check_root(root: str, storage_options: Optional[Mapping[str, Any]] = None,
               saving: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system and path of ``root``, or ``CheckpointRootError`` naming the root and the fix.

    A local root of a saving run is created here (as the first save would) and
    must be writable; a root that exists must be a directory, locally or on
    any fsspec storage.
    """
    try:
        fs, path = get_fs(root, **dict(storage_options or {}))
    except (ValueError, ImportError) as e:
        raise CheckpointRootError(
            f"checkpoint root {root!r} cannot be opened ({e}); give a local directory or an fsspec URL whose "
            "protocol is installed (s3:// needs s3fs, gs:// needs gcsfs)") from None
    if is_local(fs):
        _check_local(root, path, saving)
    elif _is_file(fs, path):
        raise CheckpointRootError(f"checkpoint root {root} is a file, not a directory; give a directory prefix")
    return fs, path


def _check_local(root: str, path: str, saving: bool) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointRootError(f"checkpoint root {root} is a regular file, not a directory; give a directory "
                                  "(it is created when missing)")
    if not saving:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointRootError(f"checkpoint root {root} cannot be created ({e.strerror or e}); give a directory "
                                  "this process can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointRootError(f"checkpoint root {root} is not writable by this process; give a directory it "
                                  "can write, or fix the permissions")


def _is_file(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    try:
        return fs.info(path).get("type") == "file"
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return False
