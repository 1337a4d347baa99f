"""What a checkpoint keeps of Accelerate's own objects: its counters, and a loader that keeps the shard's epoch."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ckpt_core import ResumableLoader

log = logging.getLogger("accelerate_ckpt")


class AcceleratorCounters:
    """Accelerate's own counters, as a ``Stateful`` kept per rank in the checkpoint.

    * ``step``: ``accelerator.step``, the gradient-accumulation counter;
    * ``save_iteration``: ``ProjectConfiguration.iteration`` *after* this save
      (stock ``load_state`` does not restore it, so the next save overwrites
      and rotation deletes the wrong checkpoint);
    * ``dataloader_iterations``: each prepared loader's ``iteration`` (its
      epoch; stock ``save_state`` does not save it).
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        return {
            "step": int(acc.step),
            "save_iteration": int(acc.project_configuration.iteration) + 1,
            "dataloader_iterations": [int(getattr(dl, "iteration", 0) or 0) for dl in acc._dataloaders],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        acc = self.accelerator
        acc.step = int(state["step"])
        acc.project_configuration.iteration = int(state["save_iteration"])
        saved = list(state["dataloader_iterations"])
        if len(saved) != len(acc._dataloaders):
            log.warning("accelerate_ckpt: the checkpoint has the epochs of %d prepared data loaders, this run "
                        "prepared %d; matching them in order", len(saved), len(acc._dataloaders))
        for dl, it in zip(acc._dataloaders, saved):
            if hasattr(dl, "iteration"):
                dl.iteration = int(it)


class AcceleratedResumableLoader(ResumableLoader):
    """``ResumableLoader`` over an Accelerate ``DataLoaderShard``: also keeps the shard's epoch in step.

    A pass that starts at the end of an epoch (a checkpoint taken after its
    last batch) yields nothing and does not advance ``DataLoaderShard.iteration``;
    the sampler does, so the shard follows the sampler after every pass.
    """

    def __iter__(self):
        yield from super().__iter__()
        if self.sampler is not None and hasattr(self.loader, "iteration"):
            self.loader.iteration = self.sampler.epoch

    @property
    def remaining(self) -> int:
        """Batches this process still yields in the current epoch; ``len()`` is the whole epoch's."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        left = getattr(batch_sampler, "remaining", None)
        return int(left) if left is not None else len(self.loader)
