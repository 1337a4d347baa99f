"""Which sampler classes are the stock ones: they only shuffle, walk or shard a map-style dataset.

A loader built on stock samplers can be rebuilt on
``ResumableDistributedSampler`` without changing what it means; a subclass
may change the order (a curriculum, a weighting), so classes are matched
exactly, never with ``isinstance``. torchdata's stateful samplers are stock
when torchdata is installed, and Accelerate's ``SeedableRandomSampler`` (the
``RandomSampler`` that ``accelerator.prepare`` puts in place of the user's)
when Accelerate has loaded it; neither is imported for this otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

RANDOM, SEQUENTIAL, DISTRIBUTED, CUSTOM = "random", "sequential", "distributed", "custom"


def _torchdata_sampler(name: str) -> tuple[type, ...]:
    try:
        from torchdata.stateful_dataloader import sampler as td_sampler
    except ImportError:  # torchdata is optional
        return ()
    return (getattr(td_sampler, name),)


def random_sampler_types() -> tuple[type, ...]:
    """Samplers that draw one permutation of the dataset per pass: torch's, torchdata's, Accelerate's."""
    found = (RandomSampler, *_torchdata_sampler("RandomSampler"))
    accelerate_data = sys.modules.get("accelerate.data_loader")
    seedable = getattr(accelerate_data, "SeedableRandomSampler", None)
    return found + ((seedable,) if seedable is not None else ())


def batch_sampler_types() -> tuple[type, ...]:
    """Batch samplers that only cut the sampler's order into batches: torch's and torchdata's."""
    return (BatchSampler, *_torchdata_sampler("BatchSampler"))


def sampler_kind(sampler: Any) -> str:
    """``random``, ``sequential``, ``distributed`` for a stock sampler (exact class), else ``custom``."""
    cls = type(sampler)
    if cls in random_sampler_types():
        return RANDOM
    if cls is SequentialSampler:
        return SEQUENTIAL
    if cls is DistributedSampler:
        return DISTRIBUTED
    return CUSTOM


def is_stock_batch_sampler(batch_sampler: Any) -> bool:
    """Whether ``batch_sampler`` is exactly one of the stock batch sampler classes."""
    return type(batch_sampler) in batch_sampler_types()
