"""A storage that fails on purpose, for testing recovery against real I/O errors.

``faulty://<path>`` wraps another fsspec file system (local by default) and
reads its faults from a small JSON control file (``storage_options={"control":
path}``), so a test can change them between saves, even when the write runs
in DCP's background process:

* ``fail_first_writes``: the first K files opened for writing (per save) raise
  ``ConnectionError`` (a transient fault; the writer retries);
* ``fail_after_bytes``: writing more than N bytes (per save) raises
  ``OSError(ENOSPC)`` (disk full; permanent, not retried);
* ``delay_per_file_s``: sleep before every file opened for writing (a slow store);
* ``delay_per_rm_s``: sleep before every file deletion (a slow delete);
* ``delay_per_read_s``: sleep before every file opened or fetched for reading (a slow read);
* ``fail_reads_matching``: reading a file whose path contains this string
  raises ``OSError(EIO)`` (a file that exists but cannot be read).
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Any

import fsspec
from fsspec import AbstractFileSystem


class _FaultyFile:
    def __init__(self, inner: Any, owner: "FaultyFileSystem") -> None:
        self._inner = inner
        self._owner = owner

    def write(self, data: Any) -> int:
        owner = self._owner
        n = memoryview(data).nbytes
        if owner.fail_after_bytes is not None and owner.bytes_written + n > owner.fail_after_bytes:
            raise OSError(errno.ENOSPC, "No space left on device (injected by faulty://)")
        owner.bytes_written += n
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __enter__(self) -> "_FaultyFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()


class FaultyFileSystem(AbstractFileSystem):
    protocol = ("faulty",)
    cachable = False

    def __init__(self, control: str | None = None, target_protocol: str = "file", **kwargs: Any) -> None:
        super().__init__(control=control, target_protocol=target_protocol, **kwargs)
        self.target = fsspec.filesystem(target_protocol)
        cfg = {}
        if control and os.path.exists(control):
            with open(control) as f:
                cfg = json.load(f)
        self.fail_first_writes = int(cfg.get("fail_first_writes", 0))
        self.fail_after_bytes = cfg.get("fail_after_bytes")
        self.delay_per_file_s = float(cfg.get("delay_per_file_s", 0.0))
        self.delay_per_rm_s = float(cfg.get("delay_per_rm_s", 0.0))
        self.delay_per_read_s = float(cfg.get("delay_per_read_s", 0.0))
        self.fail_reads_matching = cfg.get("fail_reads_matching")
        self.bytes_written = 0
        self.writes_failed = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = path[len("faulty://"):] if path.startswith("faulty://") else path
        return path.rstrip("/") or "/"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode or "a" in mode:
            if self.writes_failed < self.fail_first_writes:
                self.writes_failed += 1
                raise ConnectionError(f"transient storage error opening {path} (injected by faulty://)")
            if self.delay_per_file_s:
                time.sleep(self.delay_per_file_s)
            self.target.makedirs(os.path.dirname(path), exist_ok=True)
            return _FaultyFile(self.target.open(path, mode, **kwargs), self)
        self._before_read(path)
        return self.target.open(path, mode, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        out = self.target.ls(self._strip_protocol(path), detail=detail, **kwargs)
        return out

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.target.info(self._strip_protocol(path), **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.makedirs(self._strip_protocol(path), exist_ok=True)

    def rm_file(self, path: str) -> None:
        if self.delay_per_rm_s:
            time.sleep(self.delay_per_rm_s)
        self.target.rm_file(self._strip_protocol(path))

    def rm(self, path: str, recursive: bool = False, maxdepth: Any = None) -> None:
        path = self._strip_protocol(path)
        if recursive and self.target.isdir(path):
            for f in sorted(self.target.find(path)):
                self.rm_file(f)
        self.target.rm(path, recursive=recursive)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def mv(self, path1: str, path2: str, recursive: bool = False, **kwargs: Any) -> None:
        self.target.mv(self._strip_protocol(path1), self._strip_protocol(path2), recursive=recursive)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.target.exists(self._strip_protocol(path))

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        self._before_read(path)
        return self.target.cat_file(path, start=start, end=end)

    def _before_read(self, path: str) -> None:
        if self.delay_per_read_s:
            time.sleep(self.delay_per_read_s)
        if self.fail_reads_matching and self.fail_reads_matching in path:
            raise OSError(errno.EIO, f"I/O error reading {path} (injected by faulty://)")


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
