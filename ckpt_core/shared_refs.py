"""Hand the checkpoint process each shared-memory staging buffer once, not once per save.

A process-mode save pickles the staged state dict to the checkpoint process
(``background``). torch's reduction sends every shared-memory storage as a
file descriptor (``multiprocessing.resource_sharer``): a new connection, an
HMAC handshake both ways and an ``SCM_RIGHTS`` message per storage, answered
by a thread of the training process that takes the GIL each time. The stager
reuses its buffers from save to save, so after the first save the checkpoint
process already holds every one of them.

``StagedRefs`` pickles the state dict with each shared CPU storage replaced by
a token (``pickle``'s persistent ids). Storages the process does not hold yet
travel beside it the usual way, once; the process keeps exactly the storages
the latest request names (``_HELD``), so a buffer the stager let go of is
released there too. ``SentStorages`` is the training side's record of what
the process holds: one per checkpoint process, cleared when a save fails or
the process is replaced, after which every storage is sent again. A closed
manager sends ``ReleaseHeld`` so that the process does not keep its buffers
(the host memory of a staged copy) until the next save or exit.
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any, Optional

import torch
from multiprocessing.reduction import ForkingPickler

_HELD: dict[int, torch.UntypedStorage] = {}
"""In the checkpoint process: the storages the training process has sent, by token."""


class SentStorages:
    """The training side's record of the storages one checkpoint process holds, each with its token.

    Each storage is kept referenced while recorded, so its address (the key)
    cannot be reused by another storage before the record drops it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_addr: dict[int, tuple[int, torch.UntypedStorage]] = {}
        self._next = 0

    def clear(self) -> None:
        """Forget everything: the next save sends every storage again (a failed save, a new process)."""
        with self._lock:
            self._by_addr.clear()

    def __len__(self) -> int:
        return len(self._by_addr)

    def wrap(self, staged: Any) -> "StagedRefs":
        """``staged`` to send to the checkpoint process with the storages it holds as tokens."""
        return StagedRefs(staged, self)

    def _pickle(self, staged: Any) -> tuple[bytes, dict[int, torch.UntypedStorage], list[int]]:
        """The tokenized pickle of ``staged``, the storages to send with it, and every token it names;
        storages of earlier saves that it does not name are forgotten."""
        with self._lock:
            buf = io.BytesIO()
            pickler = _TokenPickler(buf, self)
            pickler.dump(staged)
            named = pickler.named
            self._by_addr = {addr: v for addr, v in self._by_addr.items() if v[0] in named}
            return buf.getvalue(), pickler.new, sorted(named)

    def _token(self, storage: torch.UntypedStorage, new: dict[int, torch.UntypedStorage]) -> int:
        addr = storage._cdata
        known = self._by_addr.get(addr)
        if known is not None:
            return known[0]
        self._next += 1
        self._by_addr[addr] = (self._next, storage)
        new[self._next] = storage
        return self._next


class _TokenPickler(ForkingPickler):
    """torch's multiprocessing pickler that writes shared CPU storages as tokens of ``SentStorages``."""

    def __init__(self, file: Any, sent: SentStorages) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._sent = sent
        self.new: dict[int, torch.UntypedStorage] = {}
        self.named: set[int] = set()

    def persistent_id(self, obj: Any) -> Optional[int]:
        if type(obj) is not torch.UntypedStorage or obj.device.type != "cpu" or not obj.is_shared():
            return None
        token = self._sent._token(obj, self.new)
        self.named.add(token)
        return token


class StagedRefs:
    """A staged state dict on its way to the checkpoint process; unpickled there, it is the state dict."""

    def __init__(self, staged: Any, sent: SentStorages) -> None:
        self.staged, self._sent = staged, sent

    def __reduce__(self) -> tuple:
        payload, new, named = self._sent._pickle(self.staged)
        return (_rebuild, (payload, new, named))


class _TokenUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> torch.UntypedStorage:
        try:
            return _HELD[pid]
        except KeyError:
            raise RuntimeError(f"the checkpoint process does not hold staged storage {pid!r}; the next save "
                               "sends every storage again") from None


class ReleaseHeld:
    """A message to the checkpoint process: let go of every staging buffer it holds."""


class ReleasingConnection:
    """The checkpoint process's end of the pipe as torch's serving loop uses it.

    ``ReleaseHeld`` messages are handled here and never reach the loop. Once a
    save is answered, its request lets go of the state dict, planner and
    writer: torch's loop keeps the request until the next one arrives, and
    with it every staged buffer; after that only ``_HELD`` holds them.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._request: Any = None

    def recv(self) -> Any:
        while True:
            obj = self._conn.recv()
            if not isinstance(obj, ReleaseHeld):
                self._request = obj
                return obj
            _HELD.clear()

    def send(self, obj: Any) -> None:
        request, self._request = self._request, None
        if request is not None and hasattr(request, "staged_state_dict"):
            request.staged_state_dict = request.planner = request.storage_writer = None
        self._conn.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _rebuild(payload: bytes, new: dict[int, torch.UntypedStorage], named: list[int]) -> Any:
    """In the checkpoint process: keep the new storages and those ``named``, drop the rest, and unpickle."""
    _HELD.update(new)
    keep = set(named)
    for token in [t for t in _HELD if t not in keep]:
        del _HELD[token]
    return _TokenUnpickler(io.BytesIO(payload)).load()
