"""Resumable data position: the global order, the sampler, the rebuild rules, the loader.

* ``order``: the pure index math (``epoch_permutation``, ``rank_indices``, ``rank_share``);
* ``sampler``: ``ResumableDistributedSampler`` and ``find_resumable_sampler``;
* ``stock``: which sampler classes are the stock ones (torch's, torchdata's);
* ``probe``: duck-typed questions (sized? keeps its own state?);
* ``spec``: ``LoaderSpec``, whether and how a loader is rebuilt on the sampler;
* ``loader``: ``ResumableLoader``, the training loader with its position.
"""

from __future__ import annotations

from .loader import GLOBAL, NONE, STATEFUL, ResumableLoader
from .order import epoch_permutation, rank_indices, rank_share
from .sampler import ResumableDistributedSampler, find_resumable_sampler
from .spec import LoaderSpec, NotRebuildable, Sharding

__all__ = [
    "GLOBAL",
    "NONE",
    "STATEFUL",
    "LoaderSpec",
    "NotRebuildable",
    "ResumableDistributedSampler",
    "ResumableLoader",
    "Sharding",
    "epoch_permutation",
    "find_resumable_sampler",
    "rank_indices",
    "rank_share",
]
