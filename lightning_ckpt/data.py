"""The training data loader as Lightning iterates it, made resumable mid-epoch.

Lightning asks its train data source for a loader, processes it (injects a
``DistributedSampler``) and iterates it through a ``CombinedLoader`` and a
data fetcher. Here the source is wrapped so that the loader Lightning gets is
a ``ResumableTrainLoader`` (a ``ckpt_core.ResumableLoader``):

* a ``DataLoader`` (or torchdata ``StatefulDataLoader``) the core can rebuild
  (``ckpt_core.data.LoaderSpec``: a sized map-style dataset, stock samplers)
  gets a ``LightningResumableSampler``
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
from typing import Any, Optional

from torch.utils.data import DataLoader

from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from lightning.pytorch.trainer.connectors.data_connector import (
    _DataLoaderSource,
    _request_dataloader,
    _worker_check,
)
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader

from ckpt_core.data import GLOBAL, NONE, STATEFUL, LoaderSpec, ResumableDistributedSampler, ResumableLoader
from ckpt_core.data.order import rank_share
from ckpt_core.data.probe import has_own_state

log = logging.getLogger("lightning_ckpt")

class LightningResumableSampler(ResumableDistributedSampler):
    """``ResumableDistributedSampler`` whose length follows Lightning's batch counting.

    Lightning counts the batches of an epoch itself and keeps that count
    across a resume, so ``len`` here is the whole epoch's (in Lightning's
    count) even when iteration starts mid-epoch: the ``base_batches`` Lightning
    counts as done plus what is left from where this epoch's counting began.
    """

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, seed: int,
                 drop_last: bool, batch_size: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size = int(batch_size)
        self.base_batches = 0
        """Batches of the current epoch that Lightning counts as done before ``epoch_start`` (after a resume)."""

    def __len__(self) -> int:
        rest = rank_share(len(self.dataset), self.epoch_start, self.num_replicas, self.drop_last)
        return self.base_batches * self.batch_size + rest

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.base_batches = 0
        super().set_epoch(epoch)

    def set_trained(self, batches: int) -> None:
        """Training went through ``batches`` batches (on every rank) since this epoch's counting began."""
        self.consumed = self.epoch_start
        self.advance(int(batches) * self.batch_size * self.num_replicas)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.base_batches = 0


class ResumableTrainLoader(ResumableLoader):
    """What Lightning iterates: the user's loader, its position and the deferred RNG restore.

    ``mode`` is ``global`` (a ``LightningResumableSampler`` inside), ``stateful``
    (the loader's own ``state_dict``, kept per rank) or ``none`` (no position).
    Attributes not defined here (``dataset``, ``batch_size``...) are the inner loader's.
    Lightning fetches one batch ahead of training when the loader has no
    length: the callback marks trained batches (``mark_trained`` at every
    ``on_train_batch_end``), and the core loader keeps what a checkpoint then
    needs (``ckpt_core.data.loader``).
    """

    def __init__(self, loader: Any, mode: str) -> None:
        super().__init__(loader, mode, marks_trained=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "mode"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _resumable_sampler(trainer: Any, raw: DataLoader) -> Optional[LightningResumableSampler]:
    """The sampler to rebuild ``raw`` on, or None when Lightning's own handling applies.

    A user's ``DistributedSampler`` keeps its split and order; otherwise the
    split is Lightning's, which shuffles training data it shards and keeps the
    user's choice on one device.
    """
    connector = trainer._accelerator_connector
    if connector.is_distributed and not connector.use_distributed_sampler:
        return None
    spec = LoaderSpec.from_dataloader(raw)
    if not isinstance(spec, LoaderSpec):
        return None
    if spec.sharding is not None:
        kw = dict(num_replicas=spec.sharding.num_replicas, rank=spec.sharding.rank, shuffle=spec.shuffle,
                  seed=spec.seed, drop_last=spec.sharding.drop_last)
    else:
        dist_kw = trainer.distributed_sampler_kwargs if connector.is_distributed else None
        dist_kw = dist_kw or {"num_replicas": 1, "rank": 0}
        shuffle = connector.is_distributed or spec.shuffle
        kw = dict(num_replicas=int(dist_kw["num_replicas"]), rank=int(dist_kw["rank"]),
                  shuffle=bool(shuffle and not trainer.overfit_batches),
                  seed=int(os.getenv("PL_GLOBAL_SEED", 0)), drop_last=False)
    return LightningResumableSampler(spec.dataset, batch_size=spec.batch_size, **kw)


def wrap_train_loader(trainer: Any, raw: Any) -> Any:
    """The loader Lightning should iterate in place of ``raw`` (see the module docstring)."""
    if isinstance(raw, ResumableTrainLoader):
        return raw
    stage = RunningStage.TRAINING
    sampler = _resumable_sampler(trainer, raw) if isinstance(raw, DataLoader) else None
    if sampler is not None:
        dl = _update_dataloader(raw, sampler, mode=stage)
        mode = GLOBAL
    elif isinstance(raw, DataLoader):
        dl = trainer._data_connector._prepare_dataloader(raw, shuffle=True, mode=stage)
        mode = STATEFUL if has_own_state(dl) else NONE
    elif has_own_state(raw) and hasattr(raw, "__iter__"):
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
