"""The global order of an epoch and each rank's share of it: pure index math.

A data position is the *global* number of samples of the current epoch that
went through training, plus the epoch and the seed. These functions
reproduce ``torch.utils.data.DistributedSampler`` exactly when nothing was
consumed; after a resume at any world size the rest of the epoch is dealt out
so that each remaining sample is seen exactly once.
"""

from __future__ import annotations

import math

import torch


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


def rank_share(n: int, consumed: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each rank reads for the rest of an epoch of ``n`` samples.

    Always ``len(rank_indices(order, consumed, num_replicas, rank, drop_last))``
    for an ``order`` of length ``n``, without building the order.
    """
    rest = n - min(max(consumed, 0), n)
    if drop_last:
        return rest // num_replicas
    return math.ceil(rest / num_replicas)
