"""Whether a data loader can be rebuilt on ``ResumableDistributedSampler``, and with what.

One rule set for every adapter: a loader can be rebuilt when it reads a
sized map-style dataset through stock samplers (``ckpt_core.data.stock``)
that visit each sample once per epoch, cut into batches of a known size.
``describe`` reads those facts off the loader's parts; ``refusal`` and
``shuffles`` decide on the facts alone (plain data, no loader needed);
``LoaderSpec.from_dataloader`` puts both together. Framework-specific
conditions (Accelerate's ``split_batches``, Lightning's sampler injection)
stay in the adapters.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from torch.utils.data import DataLoader, IterableDataset

from . import stock
from .probe import sized_len

_SET_BY_REBUILD = ("self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


@dataclass(frozen=True)
class LoaderFacts:
    """What the rebuild decision looks at, as plain data."""

    iterable: bool
    """The dataset is an ``IterableDataset``."""
    length: Optional[int]
    """``len(dataset)``; None when it has none."""
    batch_sampler: str
    """Class name of the batch sampler."""
    stock_batch_sampler: bool
    batch_size: Optional[int]
    sampler: str
    """Class name of the sampler."""
    kind: str
    """``stock.sampler_kind`` of the sampler."""
    replacement: bool = False
    num_samples: Optional[int] = None
    """Samples a random sampler draws per pass."""
    sampler_shuffle: bool = False
    """A ``DistributedSampler``'s own ``shuffle``."""


def refusal(facts: LoaderFacts) -> Optional[str]:
    """None when a loader with these facts can be rebuilt on the resumable sampler, else the reason."""
    if facts.iterable:
        return "it reads an IterableDataset (its position is the loader's own state, if any)"
    if facts.length is None:
        return "its dataset has no len()"
    if not facts.stock_batch_sampler:
        return f"its batch sampler is a custom {facts.batch_sampler}"
    if facts.batch_size is None:
        return "it was built with batch_sampler= and has no batch_size"
    if facts.kind == stock.RANDOM and (facts.replacement or facts.num_samples != facts.length):
        return "its RandomSampler draws with replacement or a custom number of samples"
    if facts.kind == stock.CUSTOM:
        return f"its sampler is a custom {facts.sampler}"
    return None


def shuffles(facts: LoaderFacts) -> bool:
    """Whether the rebuilt loader shuffles: as the sampler it replaces did."""
    if facts.kind == stock.DISTRIBUTED:
        return facts.sampler_shuffle
    return facts.kind == stock.RANDOM


def describe(dataset: Any, sampler: Any, batch_sampler: Any, batch_size: Optional[int]) -> LoaderFacts:
    """The facts ``refusal`` decides on, read off a loader's parts."""
    iterable = isinstance(dataset, IterableDataset)
    kind = stock.sampler_kind(sampler)
    return LoaderFacts(
        iterable=iterable,
        length=None if iterable else sized_len(dataset),
        batch_sampler=type(batch_sampler).__name__,
        stock_batch_sampler=stock.is_stock_batch_sampler(batch_sampler),
        batch_size=batch_size,
        sampler=type(sampler).__name__,
        kind=kind,
        replacement=bool(getattr(sampler, "replacement", False)),
        num_samples=sampler.num_samples if kind == stock.RANDOM else None,
        sampler_shuffle=bool(getattr(sampler, "shuffle", False)),
    )


def sampler_seed(sampler: Any, use_generator: bool = True) -> Optional[int]:
    """The seed that fixes ``sampler``'s order, when it carries one.

    A ``DistributedSampler``'s ``seed``; else its generator's initial seed
    (unless ``use_generator`` is False: a generator a framework put there is
    not the user's); else an ``initial_seed`` attribute (Accelerate's
    ``SeedableRandomSampler``).
    """
    if stock.sampler_kind(sampler) == stock.DISTRIBUTED:
        return int(sampler.seed)
    generator = getattr(sampler, "generator", None)
    if generator is not None and use_generator:
        return generator.initial_seed()
    initial = getattr(sampler, "initial_seed", None)
    return None if initial is None else int(initial)


def loader_kwargs(loader: Any) -> dict[str, Any]:
    """The ``DataLoader`` arguments a rebuild keeps (workers, collate_fn, pinning...), read off ``loader``."""
    params = inspect.signature(DataLoader.__init__).parameters
    return {k: getattr(loader, k, p.default) for k, p in params.items() if k not in _SET_BY_REBUILD}


@dataclass(frozen=True)
class Sharding:
    """A ``DistributedSampler``'s own split of the epoch, kept by a rebuild that honours it."""

    num_replicas: int
    rank: int
    drop_last: bool


@dataclass(frozen=True)
class NotRebuildable:
    """Why a loader cannot be rebuilt on the resumable sampler."""

    reason: str


@dataclass(frozen=True)
class LoaderSpec:
    """How to rebuild a loader on ``ResumableDistributedSampler``: what it reads and how it batches."""

    dataset: Any
    batch_size: int
    drop_last: bool
    shuffle: bool
    seed: Optional[int]
    """The seed of the replaced sampler's order, if it had one (``sampler_seed``)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The other ``DataLoader`` arguments (``loader_kwargs``)."""
    sharding: Optional[Sharding] = None
    """Set when the replaced sampler was a ``DistributedSampler``."""

    @classmethod
    def from_dataloader(cls, loader: Any) -> Union["LoaderSpec", NotRebuildable]:
        """The spec of a ``DataLoader`` (or torchdata ``StatefulDataLoader``), or why there is none."""
        return cls.from_parts(loader.dataset, loader.sampler, loader.batch_sampler, loader.batch_size,
                              loader.drop_last, kwargs_source=loader)

    @classmethod
    def from_parts(cls, dataset: Any, sampler: Any, batch_sampler: Any, batch_size: Optional[int],
                   drop_last: bool, kwargs_source: Any, use_generator_seed: bool = True,
                   ) -> Union["LoaderSpec", NotRebuildable]:
        """The spec of a loader given as parts (an adapter unwraps its framework's wrappers first)."""
        facts = describe(dataset, sampler, batch_sampler, batch_size)
        reason = refusal(facts)
        if reason is not None:
            return NotRebuildable(reason)
        sharding = None
        if facts.kind == stock.DISTRIBUTED:
            sharding = Sharding(int(sampler.num_replicas), int(sampler.rank), bool(sampler.drop_last))
        return cls(
            dataset=dataset,
            batch_size=int(batch_size),
            drop_last=bool(drop_last),
            shuffle=shuffles(facts),
            seed=sampler_seed(sampler, use_generator_seed),
            kwargs=loader_kwargs(kwargs_source),
            sharding=sharding,
        )
