"""``ResumableLoader``: the training loader with its position, counting what was trained, not what was fetched.

Two ways to count, one loader:

* a plain training loop takes a batch and trains it before it asks for the
  next one, so each batch handed out counts as trained, and a full pass
  moves the sampler to the next epoch;
* a framework that fetches ahead of training (Lightning) builds the loader
  with ``marks_trained=True``, calls ``mark_trained()`` after each trained
  batch and sets the sampler's epochs itself.

The RNG state of a restore is applied right *after* the loader's iterator is
created, because creating an iterator draws from the global RNG. When the
framework fetches ahead from a loader without length that keeps its own
position, the loader's state after each of the last few batches and the RNG
state before each fetch are kept, so that a checkpoint holds the loader as it
was after the batches training saw (see ``ResumableLoader.state_dict``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from .. import rng as rng_mod
from .probe import has_own_state, sized_len
from .sampler import ResumableDistributedSampler, find_resumable_sampler

# Where the position lives: in the resumable sampler, in the loader's own ``state_dict``, nowhere.
GLOBAL, STATEFUL, NONE = "global", "stateful", "none"
_END = object()


def _batch_size(loader: Any) -> Optional[int]:
    """The loader's batch size; a DataLoader built with ``batch_sampler=`` has it on the batch sampler."""
    batch_size = getattr(loader, "batch_size", None)
    if batch_size is None:
        batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return batch_size


def _position_mode(loader: Any, sampler: Optional[ResumableDistributedSampler]) -> str:
    if sampler is not None:
        return GLOBAL
    if has_own_state(loader):
        return STATEFUL
    raise ValueError(
        "ResumableLoader needs a DataLoader whose sampler is a ResumableDistributedSampler "
        "(DataLoader(dataset, sampler=ResumableDistributedSampler(dataset), ...)) or a "
        "torchdata StatefulDataLoader"
    )


class ResumableLoader:
    """Wraps the training data loader so that a resume continues exactly where training was.

    * With a ``ResumableDistributedSampler`` inside (mode ``global``), each
      trained batch advances the global position by ``batch_size * num_replicas``.
    * With a loader that has its own ``state_dict`` (mode ``stateful``: a
      torchdata ``StatefulDataLoader``), that state is the position, per rank.
    * ``mode`` is found from the loader unless given; an adapter may give
      ``none`` (no position: ``state_dict()`` is empty).
    """

    def __init__(self, loader: Any, mode: Optional[str] = None, *, marks_trained: bool = False) -> None:
        self.loader = loader
        sampler = find_resumable_sampler(loader)
        self.mode = _position_mode(loader, sampler) if mode is None else mode
        self.sampler = sampler if self.mode == GLOBAL else None
        batch_size = _batch_size(loader)
        if self.mode == GLOBAL and self.sampler is None:
            raise ValueError("ResumableLoader(mode='global') needs a ResumableDistributedSampler in the loader")
        if self.sampler is not None and batch_size is None:
            raise ValueError("ResumableLoader needs a DataLoader with batch_size set")
        self.batch_size = int(batch_size or 0)
        self.marks_trained = marks_trained
        self._pending: Optional[Callable[[], None]] = None
        self._prefetch_rng: Optional[dict] = None  # restored: the RNG state before the first fetch
        self._ahead = marks_trained and self.mode == STATEFUL and sized_len(loader) is None
        self._skip = 0
        self._begin_pass()

    @property
    def epoch(self) -> int:
        """The sampler's epoch (0 without a resumable sampler)."""
        return self.sampler.epoch if self.sampler is not None else 0

    def __len__(self) -> int:
        return len(self.loader)

    def skip_next(self, batches: int) -> None:
        """The next pass reads and drops its first ``batches`` batches.

        For a loader that keeps no position (mode ``none``): after a resume in
        the middle of an epoch, the batches already trained are not trained
        again. Exact when the stream yields the same batches on every pass;
        costs reading them.
        """
        self._skip = max(0, int(batches))

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the RNG restore) right after the next iterator is created."""
        self._pending = fn

    def _begin_pass(self) -> None:
        """Reset the per-pass counters; a restored pre-fetch RNG state goes to this pass."""
        self._yielded = self._trained = 0
        self._after: dict[int, Any] = {}  # batches yielded -> loader state after them
        self._rng_before: dict[int, Any] = {}  # batch number -> RNG state before it was fetched
        self._exhausted = False
        self._fetch_rng, self._prefetch_rng = self._prefetch_rng, None

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        restore, self._pending = self._pending, None
        self._begin_pass()
        skip, self._skip = self._skip, 0
        for _ in range(skip):  # before the RNG restore: reading them must not move the restored RNG
            if next(it, _END) is _END:
                break
        if restore is not None and not self._ahead:
            restore()  # creating the iterator drew from the RNG; training continues from the saved state
            restore = None
        while True:
            if self._ahead:
                restore = self._before_fetch(restore)
            try:
                batch = next(it)
            except StopIteration:
                self._exhausted = True
                if restore is not None:
                    restore()
                break
            self._yielded += 1
            if self._ahead:
                self._after[self._yielded] = self.loader.state_dict()
                self._after.pop(self._yielded - 3, None)
            if not self.marks_trained:
                self._count_trained()
            yield batch
        if not self.marks_trained and self.sampler is not None:
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def _before_fetch(self, restore: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """Lookahead bookkeeping before a fetch; returns the restore still to run, if any.

        The framework fetched the first batch ahead under the RNG state the
        original run had then; once training goes on (a second fetch), the RNG
        is the checkpoint's.
        """
        if restore is not None and self._yielded:
            restore()
            restore = None
        if self._fetch_rng is not None:
            rng_mod.apply(self._fetch_rng)
            self._rng_before[1], self._fetch_rng = self._fetch_rng, None
        else:
            self._rng_before[self._yielded + 1] = rng_mod.capture()
        self._rng_before.pop(self._yielded - 2, None)
        return restore

    def mark_trained(self) -> None:
        """One more batch of this pass went through training (a loader built with ``marks_trained=True``)."""
        if not self.marks_trained:
            raise RuntimeError("this ResumableLoader counts each batch it hands out as trained; "
                               "build it with marks_trained=True to mark trained batches instead")
        self._count_trained()

    def _count_trained(self) -> None:
        self._trained += 1
        if self.sampler is not None:
            self.sampler.advance(self.batch_size * self.sampler.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        """The position: the sampler's (global), the loader's own (per rank), or nothing."""
        if self.sampler is not None:
            return self.sampler.state_dict()
        if self.mode == NONE:
            return {}
        if not self.marks_trained:
            return self.loader.state_dict()
        n = self._trained
        if self._ahead and not (self._exhausted and n == self._yielded) and n in self._after:
            return {"loader": self._after[n], "rng_before_next": self._rng_before.get(n + 1)}
        return {"loader": self.loader.state_dict(), "rng_before_next": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by ``state_dict``; takes effect at the next pass."""
        if self.sampler is not None:
            self.sampler.load_state_dict(state)
        elif self.mode == STATEFUL and not self.marks_trained:
            self.loader.load_state_dict(state)
        elif self.mode == STATEFUL and state:
            self.loader.load_state_dict(state["loader"])
            self._prefetch_rng = state.get("rng_before_next")
