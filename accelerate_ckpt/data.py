"""Rebuild Accelerate's training data loaders on ``ckpt_core.ResumableDistributedSampler``.

Accelerate shards a plain ``DataLoader`` by wrapping its batch sampler in
``BatchSamplerShard``; the permutation then comes from a ``RandomSampler``
whose generator is seeded from the global RNG and never saved, so a resumed
run cannot find its place in the epoch (``skip_first_batches`` skips over a
different permutation). Here the same loader is rebuilt on the core's
sampler instead:

* the global order of an epoch is ``randperm(n, seed + epoch)``, the order of
  ``DistributedSampler``, dealt round-robin to ``num_processes`` ranks;
* the position (epoch, global samples consumed, seed) is saved by the core
  and survives a change of the process count;
* the rebuilt loader has a private ``torch.Generator``, so creating an
  iterator never draws from the global RNG (restoring the RNG state before or
  after the iterator is created gives the same stream).

Everything else is Accelerate's: the result is a ``DataLoaderShard`` (device
placement, ``GradientState``, ``end_of_dataloader``), built by Accelerate's own
``prepare_data_loader`` with one process so that it does not shard again.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from torch.utils.data import BatchSampler, DataLoader

from ckpt_core.data import LoaderSpec, NotRebuildable, ResumableDistributedSampler, find_resumable_sampler
from ckpt_core.data.order import rank_share
from ckpt_core.data.stock import random_sampler_types

log = logging.getLogger("accelerate_ckpt")

REBUILT_FLAG = "_ckpt_resumable"


class ShardedBatchSampler(BatchSampler):
    """A ``BatchSampler`` over a ``ResumableDistributedSampler`` that tells Accelerate the process count.

    ``DataLoaderShard.total_batch_size`` reads ``num_processes`` from the batch
    sampler (as it does from Accelerate's own ``BatchSamplerShard``).
    """

    def __init__(self, sampler: ResumableDistributedSampler, batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.num_processes = sampler.num_replicas
        self.process_index = sampler.rank
        self.split_batches = False

    def __len__(self) -> int:
        """Batches of a whole epoch for this process (``len(dataloader)`` as stock means it), also mid-epoch."""
        return self._batches(rank_share(len(self.sampler.dataset), 0, self.num_processes, self.sampler.drop_last))

    @property
    def remaining(self) -> int:
        """Batches this process still yields in the current epoch (fewer than ``len`` after a mid-epoch resume)."""
        return self._batches(len(self.sampler))

    def _batches(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)


def _stateful_classes() -> tuple[type, ...]:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # torchdata is optional
        return ()
    return (StatefulDataLoader,)


def is_rebuilt(loader: Any) -> bool:
    return bool(getattr(loader, REBUILT_FLAG, False)) or find_resumable_sampler(loader) is not None or (
        find_resumable_sampler(getattr(loader, "base_dataloader", None)) is not None
    )


def is_stateful(loader: Any) -> bool:
    """Whether ``loader`` (raw or prepared by Accelerate) keeps its own position (torchdata ``StatefulDataLoader``)."""
    classes = _stateful_classes()
    if not classes:
        return False
    if getattr(loader, "use_stateful_dataloader", False):
        return True
    base = getattr(loader, "base_dataloader", loader)
    return isinstance(base, classes)


def _prepared_spec(loader: Any, base: Any) -> Union[LoaderSpec, NotRebuildable]:
    """The core's spec of a loader Accelerate prepared: its ``BatchSamplerShard`` unwrapped.

    The sampler's generator is not the user's there (Accelerate may have put
    one drawn from the global RNG), so the seed comes from ``initial_seed``
    (``SeedableRandomSampler``) or from the accelerator.
    """
    if type(loader).__name__ == "DataLoaderDispatcher" or getattr(loader, "split_batches", False):
        return NotRebuildable("it dispatches or splits batches")
    from accelerate.data_loader import BatchSamplerShard, get_sampler

    batcher = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    if isinstance(batcher, BatchSamplerShard):
        if batcher.split_batches:
            return NotRebuildable("it splits batches")
        batcher = batcher.batch_sampler
    return LoaderSpec.from_parts(loader.dataset, get_sampler(loader), batcher, getattr(batcher, "batch_size", None),
                                 getattr(batcher, "drop_last", False), kwargs_source=base, use_generator_seed=False)


def _spec(loader: Any) -> Union[LoaderSpec, NotRebuildable]:
    """What is needed to rebuild ``loader`` (a raw DataLoader or one Accelerate prepared), or why it cannot be.

    The core's rules (``LoaderSpec``), plus one of Accelerate's: it shards
    the batches itself, so a loader whose ``DistributedSampler`` already
    shards is left to it.
    """
    base = getattr(loader, "base_dataloader", None)
    spec = LoaderSpec.from_dataloader(loader) if base is None else _prepared_spec(loader, base)
    if isinstance(spec, LoaderSpec) and spec.sharding is not None:
        return NotRebuildable("its sampler is a DistributedSampler (Accelerate shards the batches itself)")
    return spec


def why_not_rebuildable(loader: Any, accelerator: Any) -> Optional[str]:
    """None when ``loader`` can be rebuilt on the resumable sampler, else the reason."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.XLA, DistributedType.MEGATRON_LM):
        return f"{accelerator.distributed_type} is not supported"
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        return "tensor/context parallel ranks share batches"
    if accelerator.split_batches:
        return "split_batches=True"
    if accelerator.dispatch_batches:
        return "dispatch_batches=True"
    spec = _spec(loader)
    return spec.reason if isinstance(spec, NotRebuildable) else None


def is_shuffled(loader: Any) -> bool:
    """Whether a raw DataLoader shuffles (the mark of a training loader)."""
    return isinstance(getattr(loader, "sampler", None), random_sampler_types())


def _agreed_seed(accelerator: Any, seed: Optional[int]) -> int:
    if seed is None:
        seed = accelerator.dataloader_config.data_seed
    if seed is None:
        # What torch's RandomSampler would draw for its permutation: one value of the global RNG.
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    seed = int(seed) % (2**62)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [seed]
        broadcast_object_list(box, from_process=0)
        seed = int(box[0])
    return seed


def rebuild(accelerator: Any, loader: Any, device_placement: Optional[bool] = None) -> Any:
    """A ``DataLoaderShard`` equivalent to ``accelerator.prepare(loader)`` but on ``ResumableDistributedSampler``.

    ``loader`` may be a raw ``DataLoader``/``StatefulDataLoader`` or one that
    Accelerate already prepared. Raises ``ValueError`` when it cannot be
    rebuilt (see ``why_not_rebuildable``).
    """
    from accelerate.data_loader import prepare_data_loader

    reason = why_not_rebuildable(loader, accelerator)
    if reason is not None:
        raise ValueError(f"cannot rebuild this data loader on a resumable sampler: {reason}")
    spec = _spec(loader)
    assert isinstance(spec, LoaderSpec)
    seed = _agreed_seed(accelerator, spec.seed)
    sampler = ResumableDistributedSampler(
        spec.dataset,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
        shuffle=spec.shuffle,
        seed=seed,
        drop_last=spec.drop_last,
    )
    batch_sampler = ShardedBatchSampler(sampler, spec.batch_size, spec.drop_last)
    kwargs = dict(spec.kwargs)
    # A private generator: the per-iterator base seed (worker seeds) no longer comes from the global RNG.
    generator = torch.Generator()
    generator.manual_seed(seed)
    kwargs["generator"] = generator
    raw = DataLoader(spec.dataset, batch_sampler=batch_sampler, **kwargs)
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = prepare_data_loader(
        raw,
        accelerator.device,
        num_processes=1,  # already sharded by the sampler
        process_index=0,
        split_batches=False,
        put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=False,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
        torch_device_mesh=None,
    )
    setattr(prepared, REBUILT_FLAG, True)
    if getattr(loader, "iteration", None) is not None:
        prepared.iteration = loader.iteration
    prepared._is_accelerate_prepared = True
    log.debug("accelerate_ckpt: rebuilt a data loader on ResumableDistributedSampler (%d replicas, seed %d)",
              accelerator.num_processes, seed)
    return prepared


def follow_epochs(skipping: Any, original: Any) -> None:
    """Make a full pass over ``skipping`` (``skip_first_batches`` of ``original``) end ``original``'s epoch too.

    Both loaders share one sampler; stock Accelerate copies the epoch counter
    (``iteration``) into the new loader and advances only that one, so the
    next pass over ``original`` would replay the epoch just finished.
    """
    cls = type(skipping)

    class _EpochFollowing(cls):  # type: ignore[misc, valid-type]
        def __iter__(self):
            yield from super().__iter__()
            original.iteration = max(int(original.iteration), int(self.iteration))

    _EpochFollowing.__name__ = _EpochFollowing.__qualname__ = cls.__name__
    # DataLoaderAdapter answers ``__class__`` with its base loader's class (a read-only property): set the
    # instance's type through object's own slot.
    object.__dict__["__class__"].__set__(skipping, _EpochFollowing)


def ensure_private_generator(loader: Any) -> None:
    """Give a loader's underlying DataLoader its own generator if it has none.

    The base seed drawn each time an iterator is created then no longer comes
    from the global RNG, so a restored RNG state is not shifted by it.
    """
    base = getattr(loader, "base_dataloader", loader)
    if isinstance(base, DataLoader) and getattr(base, "generator", None) is None:
        g = torch.Generator()
        g.manual_seed(0)
        try:
            base.generator = g
        except AttributeError:  # pragma: no cover - a frozen DataLoader attribute
            pass
