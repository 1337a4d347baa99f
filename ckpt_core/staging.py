"""DCP's stager, with the host copies of large storages starting at a page boundary.

An asynchronous save first copies the state into host buffers that are
reused from save to save (DCP's ``DefaultStager``). A direct write
(``direct_io``) sends the whole blocks of a large tensor straight from its
staged copy only when that copy starts at a block boundary; otherwise every
byte goes through the writer's aligned buffer first, a second copy of the
whole state. Shared memory (``async_mode="process"``) is page-aligned by
construction; the private memory of ``async_mode="thread"`` comes from the
CPU allocator, which aligns to 64 bytes. ``AlignedStager`` gives the thread
mode's storages of at least ``direct_io.STRAIGHT_MIN`` bytes their own
anonymous mapping instead (page-aligned, returned to the system when the
stager lets go of it). ``async_mode="bytes"`` stages every storage of a page
or more in the ``shared_arena`` (page-aligned, shared with the byte writer process by one
descriptor per chunk). Pinned staging (a CUDA host) and the shared memory of
``async_mode="process"`` stay as DCP makes them, and so does everything when
DCP's private stager is not the one this module knows.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

try:  # private to DCP: without it, staging stays DCP's own
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
except ImportError:  # pragma: no cover - a torch that moved it
    StateDictStager = object  # type: ignore[assignment,misc]

from .direct_io import STRAIGHT_MIN
from .shared_arena import ARENA, AVAILABLE as ARENA_AVAILABLE, MIN_BYTES as ARENA_MIN


def aligned_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of ``nbytes`` bytes (at least 1) starting at a page boundary; it keeps its mapping
    alive and unmaps it when freed."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()


class _AlignedStateDictStager(StateDictStager):
    """``StateDictStager`` that allocates the first copy of a storage page-aligned with ``allocate`` (later saves
    copy into the cached copy, as DCP does): storages of at least ``min_bytes``, unless DCP shares or pins them."""

    def __init__(self, allocate: Optional[Callable[[int], torch.UntypedStorage]] = None,
                 min_bytes: int = STRAIGHT_MIN) -> None:
        super().__init__(pin_memory=False, share_memory=False)
        self._allocate = allocate or aligned_storage
        self._min_bytes = max(1, min_bytes)

    def _stage_untyped_storage(self, storage: Any, non_blocking: bool = False) -> Any:
        if (self.share_memory or self.pin_memory or storage.nbytes() < self._min_bytes
                or storage in self._cached_storage_mapping):
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
        staged = self._allocate(storage.nbytes())
        staged.copy_(storage, non_blocking=non_blocking)
        self._cached_storage_mapping[storage] = staged
        return staged


class AlignedStager(DefaultStager):
    """``DefaultStager`` whose private (neither shared nor pinned) host copies of large storages are
    page-aligned, so direct writes send them without a bounce copy.

    ``arena`` (``async_mode="bytes"``): every storage of at least ``shared_arena.MIN_BYTES`` goes to the shared
    ``shared_arena`` instead, or, where DCP pins its copies (a CUDA host), its stager is not the one known here or
    the platform has no ``memfd`` (not Linux), every storage goes to DCP's shared memory.
    """

    def __init__(self, options: StagingOptions, arena: bool = False) -> None:
        super().__init__(dataclasses.replace(options, use_shared_memory=options.use_shared_memory or arena))
        plain = getattr(self, "_state_dict_stager", None)
        if type(plain) is not StateDictStager or plain.pin_memory:
            return
        if arena and ARENA_AVAILABLE:
            self._state_dict_stager = _AlignedStateDictStager(ARENA.storage, ARENA_MIN)
        elif not plain.share_memory:
            self._state_dict_stager = _AlignedStateDictStager()
