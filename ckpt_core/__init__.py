"""Fault-tolerant checkpointing for PyTorch training: the framework-agnostic core."""

__version__ = "0.1.0"

from .discovery import choose_for_restore, list_records, validate  # noqa: E402
from .manager import CheckpointManager, RestoreError, SaveError, SaveStats  # noqa: E402
from .manifest import Manifest, ManifestError  # noqa: E402
from .preemption import Preempted  # noqa: E402
from .records import CheckpointInfo, CheckpointRecord  # noqa: E402
from .sampler import ResumableDistributedSampler, ResumableLoader  # noqa: E402
from .settings import CheckpointSettings  # noqa: E402
from .state import StateMismatchError, TrainState  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointSettings",
    "Manifest",
    "ManifestError",
    "Preempted",
    "ResumableDistributedSampler",
    "ResumableLoader",
    "RestoreError",
    "SaveError",
    "SaveStats",
    "StateMismatchError",
    "TrainState",
    "choose_for_restore",
    "list_records",
    "validate",
]
