"""``ResumableDistributedSampler``: ``DistributedSampler``'s order, with a global position that survives a resume.

The position is what training went through, not what the loader drew: a
data loader draws indices ahead of training (worker prefetch, a framework's
lookahead), so the sampler never moves its own position while iterating.
Whoever sees batches go through training calls ``advance`` (``ResumableLoader``
does, see ``ckpt_core.data.loader``).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sized

from torch.utils.data import Sampler

from .order import epoch_permutation, rank_indices, rank_share


def _world(num_replicas: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    """``(num_replicas, rank)``, each defaulting to the initialized process group's (else 1 and 0)."""
    import torch.distributed as dist

    live = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if live else 1
    if rank is None:
        rank = dist.get_rank() if live else 0
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
    return num_replicas, rank


class ResumableDistributedSampler(Sampler[int]):
    """Drop-in for ``DistributedSampler`` that can start mid-epoch at any world size.

    ``state_dict()`` holds the global position (epoch, samples consumed, seed).
    ``consumed`` counts the samples of this epoch that went through training
    (``advance``); ``epoch_start`` is where this epoch's counting began (0, or
    the restored position), for a framework that counts an epoch's batches
    from its beginning (see ``lightning_ckpt.LightningResumableSampler``).
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
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        self.epoch_start = 0

    def __iter__(self) -> Iterator[int]:
        order = epoch_permutation(len(self.dataset), self.epoch, self.seed, self.shuffle)
        return iter(rank_indices(order, self.consumed, self.num_replicas, self.rank, self.drop_last))

    def __len__(self) -> int:
        return rank_share(len(self.dataset), self.consumed, self.num_replicas, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (unless it is the epoch being resumed)."""
        if epoch != self.epoch:
            self.consumed = self.epoch_start = 0
        self.epoch = epoch

    def advance(self, global_samples: int) -> None:
        """Training went through ``global_samples`` more samples (all ranks together)."""
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
        self.consumed = self.epoch_start = int(state["consumed"])


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
