"""Unpickle DCP's ``.metadata`` without ever running code from storage.

DCP writes its metadata with ``pickle``. A plain ``pickle.load`` of a file
from a shared bucket runs whatever the file names (``os.system``...). This
unpickler admits an exact set of ``(module, name)`` globals: the metadata
dataclasses and enums that DCP writes (taken from the files torch 2.6 to 2.14
really write, see ``tests/fixtures/dcp_metadata/``), ``torch.Size``, the torch
dtypes, the layout lookup and the path class of ``StorageMeta``. No module
prefix, no dotted name, and no ``BUILD`` on a class (which would rewrite
attributes of an allowed class for the rest of the process).
"""

from __future__ import annotations

import gc
import importlib
import io
import pickle
from typing import Any

import torch


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks to load something that is not plain checkpoint data (a global outside the allowlist)."""


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
}) | frozenset(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
"""Every global the unpickler resolves; anything else is ``UnsafeCheckpointError``.

Exactly what torch 2.6.0 to 2.14.1 write into ``.metadata`` (pickle protocol 4, the same set in every
release: tests/fixtures/dcp_metadata/ holds a file of each), with the dtype globals for every torch dtype.
``PosixPath`` is the ``StorageMeta.checkpoint_id`` of ``FileSystemWriter``; ``_get_layout`` maps a layout
name ("torch.strided") to the layout object, refusing unknown names.
"""


class _AllowlistUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's own unpickler with ``find_class`` and ``BUILD`` restricted.

    The pure-Python unpickler is used because ``BUILD`` cannot be checked in
    the C one. It is slower: 10.8 MiB of ``.metadata`` (512 sharded ranks,
    ``benchmarks/scale.py``) take 3.7 s against 0.85 s for ``pickle.loads``,
    2.6 s with the cyclic garbage collector paused, as ``load_dcp_metadata`` does.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(
                f"{self.source} asks to load the global {_show(module)}.{_show(name)}, which is not DCP checkpoint "
                "metadata; refusing to load it (a crafted or foreign file: do not load this checkpoint)")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source} holds a persistent id; DCP metadata never does")

    def _load_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise UnsafeCheckpointError(
                f"{self.source} tries to set attributes of the class {self.stack[-2].__qualname__}; refusing it")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, or ``UnsafeCheckpointError``/``UnpicklingError``."""
    from torch.distributed.checkpoint.metadata import Metadata

    collecting = gc.isenabled()
    gc.disable()  # the unpickler allocates millions of objects, none cyclic: collections would only rescan them
    try:
        obj = _AllowlistUnpickler(data, source).load()
    except pickle.UnpicklingError as e:  # pickle's own ("pickle exhausted before end of frame") names no file
        if source in str(e):
            raise
        raise pickle.UnpicklingError(f"{source} is not valid DCP metadata ({e})") from None
    except RecursionError:
        raise pickle.UnpicklingError(f"{source} is nested too deeply to be DCP metadata") from None
    except Exception as e:  # noqa: BLE001 - any other failure of a malformed pickle: not loadable
        raise pickle.UnpicklingError(f"{source} is not valid DCP metadata ({type(e).__name__}: {e})") from None
    finally:
        if collecting:
            gc.enable()
    if not isinstance(obj, Metadata):
        raise pickle.UnpicklingError(f"{source} does not hold DCP metadata (it holds a {type(obj).__name__})")
    _check_storage_data(obj, source)
    return obj


def _check_storage_data(metadata: Any, source: str) -> None:
    """Every item lies in a plain file of the checkpoint directory, at a non-negative offset and length.

    The readers join ``relative_path`` to the checkpoint directory; a path with
    a separator or ``..`` would read a file outside it into the state.
    """
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise pickle.UnpicklingError(f"{source}: storage_data is a {type(storage).__name__}, not a dict")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if (not isinstance(name, str) or not name or len(name) > 255 or name in (".", "..")
                or any(c in name for c in "/\\\0")):
            raise UnsafeCheckpointError(f"{source} places an item in {_show(repr(name))}, which is not a file of "
                                        "the checkpoint directory; refusing to read it")
        for field in ("offset", "length"):
            value = getattr(info, field, None)
            if type(value) is not int or value < 0:
                raise pickle.UnpicklingError(f"{source}: an item of {name} has {field} {_show(repr(value))}")


def _show(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
