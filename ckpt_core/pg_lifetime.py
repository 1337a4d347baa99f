"""A DDP's process group outlives the DDP, so that gloo's destructor never runs inside DDP's.

Python frees a process group with the GIL released; the reducer inside a
``DistributedDataParallel`` frees it holding the GIL. When
``destroy_process_group()`` runs while a DDP module is still alive
(Accelerate's ``end_training`` does, before the script's model goes out of
scope), the reducer holds the last reference: gloo's destructor then joins its
worker threads under the GIL while a worker waits for the GIL to release a
tensor of the last collective, and the process hangs at exit (seen at 4 ranks
on 2 busy cores, about one run in fifteen).

``hold_process_group`` keeps a Python reference next to the reducer's. Once
the DDP is gone the reference is dropped from Python (GIL released, no hang);
a group whose DDP is still alive at interpreter exit is never freed, since
the process is ending anyway.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from typing import Any

_LOCK = threading.Lock()
_HELD: list[tuple[weakref.ref, Any]] = []


def hold_process_group(ddp: Any) -> None:
    """Keep ``ddp.process_group`` referenced from Python for as long as ``ddp`` lives."""
    release_orphaned()
    group = getattr(ddp, "process_group", None)
    if group is None:
        return
    with _LOCK:
        if not any(ref() is ddp for ref, _ in _HELD):
            _HELD.append((weakref.ref(ddp), group))


def held_count() -> int:
    """How many groups are held for live DDP modules (tests, diagnostics)."""
    with _LOCK:
        return len(_HELD)


def release_orphaned() -> None:
    """Drop the references whose DDP has been freed (from Python: the destructor runs without the GIL)."""
    with _LOCK:
        orphaned = [group for ref, group in _HELD if ref() is None]
        _HELD[:] = [(ref, group) for ref, group in _HELD if ref() is not None]
    del orphaned


@atexit.register
def _at_exit() -> None:
    release_orphaned()
    with _LOCK:
        for _, group in _HELD:  # the DDP is freed during finalization: it must not hold the last reference
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
