"""CRC32Cs of staged tensors, taken by a save's fingerprint pass and handed to its writer.

A save reads every staged tensor twice: the fingerprint pass sums it, and
the writer takes the CRC32C of the bytes it writes. The pass can take each
block's CRC32C right after summing the block, while it is in the CPU's cache
(``fingerprint.entry_and_crc``): 0.04 s per GiB instead of a CRC32C pass of
0.07 s over memory. The writer, about to write a buffer that is exactly a
staged tensor's bytes (the same address and length), takes that CRC instead
of computing its own.

Neither side waits long: a tensor the pass has not started when the writer
reaches it is left to the writer (the pass then skips its CRC); the writer
waits only while the pass is summing that very tensor. A pass that fails or
ends hands everything it has not delivered back to the writer.
"""

from __future__ import annotations

import threading
from typing import Iterable, Optional

Key = tuple[int, int]
"""(address, number of bytes) of a staged tensor's data."""

_PLANNED = "planned"
_RUNNING = "running"
_WRITER = "writer"


class StagedCrcs:
    """Who takes the CRC32C of each staged tensor, and the CRCs the fingerprint pass took."""

    def __init__(self, keys: Iterable[Key]) -> None:
        self._cond = threading.Condition()
        self._state: dict[Key, object] = {key: _PLANNED for key in keys}
        self.taken = 0
        """How many buffers the writer took the pass's CRC for."""

    def begin(self, key: Key) -> bool:
        """The pass is about to sum ``key``: whether it takes its CRC too (False: the writer claimed it,
        another pass took it, or it was never planned)."""
        with self._cond:
            if self._state.get(key) is not _PLANNED:
                return False
            self._state[key] = _RUNNING
            return True

    def done(self, key: Key, crc: Optional[int]) -> None:
        """The pass summed ``key`` (after ``begin`` returned True); ``crc`` None: it could not take it."""
        with self._cond:
            self._state[key] = crc if crc is not None else _WRITER
            self._cond.notify_all()

    def close(self) -> None:
        """The pass ended, or failed: what it did not deliver is the writer's."""
        with self._cond:
            for key, state in self._state.items():
                if state is _PLANNED or state is _RUNNING:
                    self._state[key] = _WRITER
            self._cond.notify_all()

    def take(self, key: Key) -> Optional[int]:
        """The writer is about to write ``key``'s bytes: their CRC32C from the pass, waiting while the pass
        sums them, or None: the writer takes it (and the pass will not)."""
        with self._cond:
            if self._state.get(key) is _PLANNED:
                self._state[key] = _WRITER
                return None
            while self._state.get(key) is _RUNNING:
                self._cond.wait()
            state = self._state.get(key)
            if isinstance(state, int):
                self.taken += 1
                return state
            return None
