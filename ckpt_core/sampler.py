"""Resumable data order: global position, resharding-aware.

The position kept in a checkpoint is the *global* number of samples consumed
in the current epoch, plus the epoch and the seed. The index math is pure and
reproduces ``torch.utils.data.DistributedSampler`` exactly when nothing was
consumed; after a resume at any world size the remaining samples of the
epoch are dealt out so that each is seen exactly once.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional, Sized

import torch
from torch.utils.data import Sampler


def epoch_permutation(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The global order of one epoch; the same as ``DistributedSampler``'s."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def rank_indices(
    order: list[int], consumed: int, num_replicas: int, rank: int, drop_last: bool
) -> list[int]:
    """Indices rank ``rank`` of ``num_replicas`` reads for the rest of the epoch.

    ``order[consumed:]`` is dealt round-robin, padded with the head of the
    epoch's order (as ``DistributedSampler`` pads) or truncated with
    ``drop_last``. With ``consumed`` a multiple of ``num_replicas`` this is
    exactly the tail of what ``DistributedSampler`` would have produced.
    """
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
    n = len(order)
    consumed = min(max(consumed, 0), n)
    rest = order[consumed:]
    if drop_last:
        rest = rest[: (len(rest) // num_replicas) * num_replicas]
    else:
        total = math.ceil(len(rest) / num_replicas) * num_replicas
        pad = total - len(rest)
        if pad and n:
            rest = rest + (order * math.ceil(pad / n))[:pad]
    return rest[rank::num_replicas]


class ResumableDistributedSampler(Sampler[int]):
    """Drop-in for ``DistributedSampler`` that can start mid-epoch at any world size.

    ``state_dict()`` holds the global position (epoch, samples consumed, seed);
    the position advances through ``advance(global_samples)``, called by the
    loop that actually consumes batches (``ResumableLoader`` does it), because
    a data loader draws indices ahead of training.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        import torch.distributed as dist

        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        self._start = 0

    def __iter__(self) -> Iterator[int]:
        order = epoch_permutation(len(self.dataset), self.epoch, self.seed, self.shuffle)
        self._start = self.consumed
        return iter(rank_indices(order, self.consumed, self.num_replicas, self.rank, self.drop_last))

    def __len__(self) -> int:
        n = len(self.dataset) - min(self.consumed, len(self.dataset))
        if self.drop_last:
            return n // self.num_replicas
        return math.ceil(n / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (unless it is the epoch being resumed)."""
        if epoch != self.epoch:
            self.consumed = 0
        self.epoch = epoch

    def advance(self, global_samples: int) -> None:
        self.consumed = min(self.consumed + global_samples, len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dataset_len"]) != len(self.dataset):
            raise ValueError(
                f"the checkpoint's data position is for a dataset of {state['dataset_len']} samples, "
                f"this one has {len(self.dataset)}; resume with the same dataset"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


def find_resumable_sampler(loader: Any) -> Optional[ResumableDistributedSampler]:
    """The ``ResumableDistributedSampler`` inside a DataLoader (sampler or batch sampler), if any."""
    for obj in (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(obj, ResumableDistributedSampler):
            return obj
    return None


class ResumableLoader:
    """Wraps the training data loader so that a resume continues exactly where training was.

    * With a ``ResumableDistributedSampler`` inside, each yielded batch
      advances the global position by ``batch_size * num_replicas`` (what
      training consumed, not what the loader prefetched); a full pass moves
      to the next epoch.
    * With a ``StatefulDataLoader`` (or any loader with ``state_dict``), its
      own state is the position.
    * After a restore, the saved RNG state is applied right *after* the
      loader's iterator is created, because creating an iterator draws from
      the global RNG; applying it before would shift dropout masks and orders.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.sampler = find_resumable_sampler(loader)
        if self.sampler is None and not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            raise ValueError(
                "ResumableLoader needs a DataLoader whose sampler is a ResumableDistributedSampler "
                "(DataLoader(dataset, sampler=ResumableDistributedSampler(dataset), ...)) or a "
                "torchdata StatefulDataLoader"
            )
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None:  # a DataLoader built with batch_sampler= has batch_size None
            batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if self.sampler is not None and batch_size is None:
            raise ValueError("ResumableLoader needs a DataLoader with batch_size set")
        self.batch_size = int(batch_size or 0)
        self._pending: Optional[Callable[[], None]] = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.sampler is not None else 0

    def __len__(self) -> int:
        return len(self.loader)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the RNG restore) right after the next iterator is created."""
        self._pending = fn

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        if self._pending is not None:
            fn, self._pending = self._pending, None
            fn()
        for batch in it:
            if self.sampler is not None:
                self.sampler.advance(self.batch_size * self.sampler.num_replicas)
            yield batch
        if self.sampler is not None:
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict() if self.sampler is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sampler is not None:
            self.sampler.load_state_dict(state)
        else:
            self.loader.load_state_dict(state)
