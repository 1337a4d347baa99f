"""Which prepared data loader is the training loader, and its resumable rebuild.

A script gives it to ``plugin.dataloader(dl)``, or the plugin finds it among
what the accelerator prepared (the rebuilt shuffled loader, or the one
stateful loader). Its position can be saved when it was rebuilt on
``ResumableDistributedSampler`` or keeps its own state (torchdata); otherwise
a warning says why a resumed run restarts the epoch.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch

from ckpt_core.data import find_resumable_sampler

from . import data as data_mod
from .counters import AcceleratedResumableLoader

log = logging.getLogger("accelerate_ckpt")


class TrainLoaderTracker:
    """The one training loader of an ``Accelerator``, resolved once, wrapped once."""

    def __init__(self, accelerator: Any, rebuild: bool) -> None:
        self._acc, self.rebuild = accelerator, rebuild
        self.train_loader: Any = None
        self.warned_no_position = False
        self._replaced: dict[int, Any] = {}
        self._wrappers: dict[int, AcceleratedResumableLoader] = {}

    def wrapper(self, dataloader: Any) -> AcceleratedResumableLoader:
        """The resumable wrapper of the training loader ``dataloader`` (the same one every epoch)."""
        resolved = self.track(dataloader)
        wrapper = self._wrappers.get(id(resolved))
        if wrapper is None:
            wrapper = self._wrappers[id(resolved)] = AcceleratedResumableLoader(resolved)
        return wrapper

    def epoch(self) -> Optional[int]:
        """The training loader's epoch, when it knows one."""
        dl = self.train_loader
        if dl is None:
            return None
        if getattr(dl, "iteration", None) is not None:
            return int(dl.iteration)
        sampler = find_resumable_sampler(dl)
        return sampler.epoch if sampler is not None else None

    def _resolve(self, dl: Any) -> Any:
        """The loader to track for ``dl``: itself, or its resumable rebuild (made once)."""
        if id(dl) in self._replaced:
            return self._replaced[id(dl)]
        if data_mod.is_rebuilt(dl):
            return dl
        acc = self._acc
        reason = data_mod.why_not_rebuildable(dl, acc) if self.rebuild else "rebuild_dataloaders=False"
        if reason is None:
            new = data_mod.rebuild(acc, dl)
            if dl in acc._dataloaders:
                acc._dataloaders[acc._dataloaders.index(dl)] = new
            else:
                acc._dataloaders.append(new)
            self._replaced[id(dl)] = new
            log.info("accelerate_ckpt: rebuilt the training data loader on ResumableDistributedSampler "
                     "(attach the plugin before accelerator.prepare() to have it rebuilt when prepared)")
            return new
        if data_mod.is_stateful(dl):
            data_mod.ensure_private_generator(dl)
            return dl
        warnings.warn(
            f"accelerate_ckpt: the data position of this loader cannot be saved ({reason}); a resumed run "
            "restarts its epoch. Use a map-style dataset with shuffle=True/False, or a torchdata "
            "StatefulDataLoader (DataLoaderConfiguration(use_stateful_dataloader=True)).", stacklevel=3)
        self.warned_no_position = True
        return dl

    def track(self, dl: Any) -> Any:
        """Make ``dl`` (or its rebuild) the training loader; an error if another one is tracked already."""
        resolved = self._resolve(dl)
        if self.train_loader is not None and self.train_loader is not resolved:
            raise ValueError(
                "CheckpointPlugin tracks the position of one training data loader and already has one; "
                "iterate other loaders (evaluation) directly, not through plugin.dataloader()")
        self.train_loader = resolved
        return resolved

    def find(self) -> Any:
        """The training loader when none was given to ``plugin.dataloader()`` yet (for ``resume()``)."""
        if self.train_loader is not None:
            return self.train_loader
        acc = self._acc
        rebuilt = [dl for dl in acc._dataloaders if getattr(dl, data_mod.REBUILT_FLAG, False)]
        if not rebuilt:
            from accelerate.data_loader import get_sampler

            shuffled = [dl for dl in acc._dataloaders
                        if isinstance(get_sampler(dl), torch.utils.data.RandomSampler)
                        and data_mod.why_not_rebuildable(dl, acc) is None]
            if not shuffled and len(acc._dataloaders) == 1:  # the only loader: the training loader
                shuffled = [dl for dl in acc._dataloaders if data_mod.why_not_rebuildable(dl, acc) is None]
            rebuilt = shuffled if self.rebuild else []
        candidates = rebuilt or [dl for dl in acc._dataloaders if data_mod.is_stateful(dl)]
        if len(candidates) > 1:
            raise ValueError(
                f"CheckpointPlugin found {len(candidates)} candidate training data loaders; call "
                "plugin.dataloader(train_dataloader) once before plugin.resume() to say which one")
        if candidates:
            return self.track(candidates[0])
        return None

    def for_state(self) -> Any:
        """The training loader when its position can be saved (rebuilt or stateful), else None."""
        dl = self.train_loader
        if dl is None:
            return None
        if data_mod.is_rebuilt(dl) or data_mod.is_stateful(dl):
            return dl
        return None
