"""The training data loader as Lightning iterates it, made resumable mid-epoch.

Lightning asks its train data source for a loader, processes it (injects a
``DistributedSampler``) and iterates it through a ``CombinedLoader`` and a
data fetcher. Here the source is wrapped so that the loader Lightning gets is
a ``ResumableTrainLoader`` (a ``ckpt_core.ResumableLoader``):

* a ``DataLoader`` (or torchdata ``StatefulDataLoader``) over a sized
  map-style dataset with a stock sampler gets a ``LightningResumableSampler``
  (``ckpt_core.ResumableDistributedSampler``: the order of
  ``DistributedSampler``, a global position that survives a world-size
  change) in place of its sampler;
* any other loader with its own ``state_dict`` (a ``StatefulDataLoader`` over
  an ``IterableDataset``, a custom sampler) keeps its own position, per rank;
  Lightning's ``DistributedSampler`` injection applies as usual;
* anything else passes through (its position is not restored; a warning says so).

The wrapper's iterator is lazy: the inner iterator is created on the first
``next``, and a restored RNG state is applied right after that (creating a
DataLoader iterator draws from the global RNG). The position saved counts the
batches that went through training (``mark_trained`` at every
``on_train_batch_end``), not what the loader has produced: Lightning fetches
one batch ahead for loaders without a length (see ``ResumableTrainLoader``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from lightning.pytorch.trainer.connectors.data_connector import (
    _DataLoaderSource,
    _request_dataloader,
    _worker_check,
)
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader

from ckpt_core import rng as rng_mod
from ckpt_core.sampler import ResumableDistributedSampler, ResumableLoader, find_resumable_sampler

log = logging.getLogger("lightning_ckpt")

GLOBAL, STATEFUL, NONE = "global", "stateful", "none"


class LightningResumableSampler(ResumableDistributedSampler):
    """``ResumableDistributedSampler`` whose length and position follow Lightning's batch counting.

    Lightning counts the batches of an epoch itself and keeps that count
    across a resume, so ``len`` here is the whole epoch's (in Lightning's
    count) even when iteration starts mid-epoch. The position saved counts the
    batches that went through training (``set_trained``), not what the loader
    has produced ahead of training.
    """

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, seed: int,
                 drop_last: bool, batch_size: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size = int(batch_size)
        self.base_batches = 0
        """Batches of the current epoch that Lightning counts as done before ``consumed`` (after a resume)."""
        self._trained: Optional[int] = None

    def __len__(self) -> int:
        return self.base_batches * self.batch_size + super().__len__()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.base_batches = 0
            self._trained = None
        super().set_epoch(epoch)

    def set_trained(self, batches: int) -> None:
        """Training consumed ``batches`` batches since this epoch's iteration started (at ``consumed``)."""
        self._trained = min(self.consumed + int(batches) * self.batch_size * self.num_replicas, len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self._trained is not None:
            out["consumed"] = self._trained
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._trained = None
        self.base_batches = 0


class ResumableTrainLoader(ResumableLoader):
    """What Lightning iterates: the user's loader, its position and the deferred RNG restore.

    ``mode`` is ``global`` (a ``LightningResumableSampler`` inside), ``stateful``
    (the loader's own ``state_dict``, kept per rank) or ``none`` (no position).
    Attributes not defined here (``dataset``, ``batch_size``...) are the inner loader's.

    Lightning fetches one batch ahead of training when the loader has no
    length. A checkpoint taken after ``n`` trained batches then has to hold
    the loader as it was after ``n`` batches (not ``n + 1``) and the RNG state
    from just before batch ``n + 1`` was fetched (fetching may draw from it:
    augmentation in ``__getitem__``). Both are kept for the last few batches;
    a resumed iteration fetches its first batch under that RNG state and then
    applies the checkpoint's RNG state, as the original run had it.
    """

    def __init__(self, loader: Any, mode: str) -> None:  # noqa: D107 - no ResumableLoader validation on purpose
        self.loader = loader
        self.mode = mode
        self.sampler = find_resumable_sampler(loader) if mode == GLOBAL else None
        self.batch_size = int(getattr(loader, "batch_size", None) or 0)
        self._pending: Optional[Callable[[], None]] = None
        self._prefetch_rng: Optional[dict] = None
        self._ahead = mode == STATEFUL and _sized_len(loader) is None
        self._after: dict[int, Any] = {}  # batches yielded -> loader state after them
        self._rng_before: dict[int, Any] = {}  # batch number -> RNG state before it was fetched
        self._yielded = self._trained = 0
        self._exhausted = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "mode"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        restore, self._pending = self._pending, None
        prefetch_rng, self._prefetch_rng = self._prefetch_rng, None
        self._yielded = self._trained = 0
        self._after, self._rng_before, self._exhausted = {}, {}, False
        if restore is not None and not self._ahead:
            restore()  # creating the iterator drew from the RNG; training continues from the saved state
            restore = None
        while True:
            if self._ahead:
                if restore is not None and self._yielded:
                    # Lightning fetched the first batch ahead (under the RNG state the original run had
                    # then); now training goes on: from here on the RNG is the checkpoint's.
                    restore()
                    restore = None
                if prefetch_rng is not None:
                    rng_mod.apply(prefetch_rng)
                    self._rng_before[1], prefetch_rng = prefetch_rng, None
                else:
                    self._rng_before[self._yielded + 1] = rng_mod.capture()
                self._rng_before.pop(self._yielded - 2, None)
            try:
                batch = next(it)
            except StopIteration:
                self._exhausted = True
                if restore is not None:
                    restore()
                return
            self._yielded += 1
            if self._ahead:
                self._after[self._yielded] = self.loader.state_dict()
                self._after.pop(self._yielded - 3, None)
            yield batch

    def mark_trained(self) -> None:
        """One more batch of this iteration went through training (called at every ``on_train_batch_end``)."""
        self._trained += 1
        if self.sampler is not None:
            self.sampler.set_trained(self._trained)

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is not None:
            return self.sampler.state_dict()
        if self.mode == NONE:
            return {}
        n = self._trained
        if self._ahead and not (self._exhausted and n == self._yielded) and n in self._after:
            return {"loader": self._after[n], "rng_before_next": self._rng_before.get(n + 1)}
        return {"loader": self.loader.state_dict(), "rng_before_next": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sampler is not None:
            self.sampler.load_state_dict(state)
        elif self.mode == STATEFUL and state:
            self.loader.load_state_dict(state["loader"])
            self._prefetch_rng = state.get("rng_before_next")


def _sized_len(obj: Any) -> Optional[int]:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _stock_samplers() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(random samplers, batch samplers) that only shuffle/batch: torch's and torchdata's."""
    try:
        from torchdata.stateful_dataloader.sampler import BatchSampler as TDBatchSampler
        from torchdata.stateful_dataloader.sampler import RandomSampler as TDRandomSampler
    except ImportError:  # torchdata is optional
        return (RandomSampler,), (BatchSampler,)
    return (RandomSampler, TDRandomSampler), (BatchSampler, TDBatchSampler)


def _plain_sampler(dl: DataLoader) -> bool:
    """Whether ``dl`` samples a sized map-style dataset with a stock sampler and batch sampler."""
    if isinstance(dl.dataset, IterableDataset) or _sized_len(dl.dataset) is None or dl.batch_size is None:
        return False
    randoms, batchers = _stock_samplers()
    if type(dl.batch_sampler) not in batchers:
        return False
    sampler = dl.sampler
    if type(sampler) in randoms:
        return not sampler.replacement and sampler._num_samples is None
    return type(sampler) in (SequentialSampler, DistributedSampler)


def wrap_train_loader(trainer: Any, raw: Any) -> Any:
    """The loader Lightning should iterate in place of ``raw`` (see the module docstring)."""
    if isinstance(raw, ResumableTrainLoader):
        return raw
    stage = RunningStage.TRAINING
    connector = trainer._accelerator_connector
    if isinstance(raw, DataLoader) and _plain_sampler(raw) and (
        connector.use_distributed_sampler or not connector.is_distributed
    ):
        old = raw.sampler
        if isinstance(old, DistributedSampler):
            kw = dict(num_replicas=old.num_replicas, rank=old.rank, shuffle=old.shuffle, seed=old.seed,
                      drop_last=old.drop_last)
        else:
            dist_kw = trainer.distributed_sampler_kwargs if connector.is_distributed else None
            dist_kw = dist_kw or {"num_replicas": 1, "rank": 0}
            # Lightning shuffles training data it shards; on one device it keeps the user's choice.
            shuffle = connector.is_distributed or isinstance(old, _stock_samplers()[0])
            kw = dict(num_replicas=int(dist_kw["num_replicas"]), rank=int(dist_kw["rank"]),
                      shuffle=bool(shuffle and not trainer.overfit_batches),
                      seed=int(os.getenv("PL_GLOBAL_SEED", 0)), drop_last=False)
        sampler = LightningResumableSampler(raw.dataset, batch_size=raw.batch_size, **kw)
        dl = _update_dataloader(raw, sampler, mode=stage)
        mode = GLOBAL
    elif isinstance(raw, DataLoader):
        dl = trainer._data_connector._prepare_dataloader(raw, shuffle=True, mode=stage)
        mode = STATEFUL if _stateful(dl) else NONE
    elif _stateful(raw) and hasattr(raw, "__iter__"):
        dl, mode = raw, STATEFUL
    else:
        return raw  # a CombinedLoader or a collection of loaders: Lightning's own handling
    dl = trainer.strategy.process_dataloader(dl)
    _worker_check(trainer=trainer, dataloader=dl, name="train_dataloader")
    _auto_add_worker_init_fn(dl, trainer.global_rank)
    return ResumableTrainLoader(dl, mode)


class ResumableTrainSource(_DataLoaderSource):
    """Lightning's train data source, handing out ``ResumableTrainLoader``s.

    ``prepare()`` builds the loader ahead of Lightning's request (so that a
    checkpoint can be restored into it before its first iterator exists);
    Lightning's next request gets that same loader. ``current`` is the loader
    handed out last (a new one after ``reload_dataloaders_every_n_epochs``).
    """

    def __init__(self, original: _DataLoaderSource, trainer: Any) -> None:
        super().__init__(original.instance, original.name)
        self.original = original
        self.trainer = trainer
        self.current: Optional[Any] = None
        self._prepared: Optional[Any] = None

    def dataloader(self) -> Any:
        if self._prepared is not None:
            out, self._prepared = self._prepared, None
            return out
        self.current = wrap_train_loader(self.trainer, super().dataloader())
        return self.current

    def prepare(self) -> Optional[Any]:
        """The loader Lightning will iterate, built now if Lightning has not asked for it yet."""
        if self.current is None and self.is_defined():
            self._prepared = _request_dataloader(self)
        return self.current

    def restore_original(self) -> None:
        self.original.instance = self.instance
        if self.trainer.fit_loop._data_source is self:
            self.trainer.fit_loop._data_source = self.original


def install_source(trainer: Any) -> ResumableTrainSource:
    """Wrap the fit loop's train data source; ``restore_original()`` undoes it."""
    source = trainer.fit_loop._data_source
    if isinstance(source, ResumableTrainSource):
        source.restore_original()
        source = source.original
    wrapper = ResumableTrainSource(source, trainer)
    trainer.fit_loop._data_source = wrapper
    return wrapper
