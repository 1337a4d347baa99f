"""Fault-tolerant checkpointing for PyTorch training: the framework-agnostic core.

Names are imported lazily so that light commands (``ckpt ls``, ``ckpt verify``)
start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointManager": "manager",
    "CheckpointRootError": "roots",
    "IntegrityError": "integrity",
    "UnsafeCheckpointError": "safe_pickle",
    "RestoreError": "errors",
    "OverwrittenStateError": "overwritten",
    "SaveError": "errors",
    "RankLostError": "rank_loss",
    "LeaseError": "lease",
    "LeaseHeldError": "lease",
    "LeaseLostError": "lease",
    "SaveStats": "saver",
    "Manifest": "manifest",
    "ManifestError": "manifest",
    "Preempted": "preemption",
    "CheckpointInfo": "records",
    "CheckpointRecord": "records",
    "ResumableDistributedSampler": "data",
    "ResumableLoader": "data",
    "CheckpointSettings": "config",
    "SettingError": "config",
    "StateMismatchError": "state",
    "TrainState": "state",
    "choose_for_restore": "discovery",
    "list_records": "discovery",
    "validate": "discovery",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
