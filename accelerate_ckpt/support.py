"""Accelerators the plugin refuses to attach to, and why: attaching would silently change training."""

from __future__ import annotations

import gc
import sys
from typing import Any


def check_supported(accelerator: Any) -> None:
    """``NotImplementedError`` naming what is supported, for DeepSpeed, Megatron-LM and a ``transformers.Trainer``."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"CheckpointPlugin does not support {accelerator.distributed_type}: its engines own their "
            "checkpoint format; use accelerator.save_state()/load_state() without the plugin")
    trainer = owning_trainer(accelerator)
    if trainer is not None:
        raise NotImplementedError(
            f"CheckpointPlugin cannot be attached to the Accelerator of a {type(trainer).__name__}: the "
            "Trainer saves with its own _save_checkpoint and builds its own data loaders, so attaching would "
            "change its data order and save nothing. Use the Trainer's save_steps/resume_from_checkpoint, or "
            "CheckpointPlugin with an Accelerate training loop (plugin.resume(), plugin.dataloader(), "
            "plugin.step()).")


def owning_trainer(accelerator: Any) -> Any:
    """The ``transformers.Trainer`` (or a subclass, e.g. TRL's) whose ``accelerator`` this is, if any."""
    if "transformers" not in sys.modules:
        return None
    for ref in gc.get_referrers(accelerator):
        owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref] \
            if isinstance(ref, dict) else [ref]
        for owner in owners:
            names = {c.__module__ + "." + c.__name__ for c in type(owner).__mro__}
            if "transformers.trainer.Trainer" in names and getattr(owner, "accelerator", None) is accelerator:
                return owner
    return None
