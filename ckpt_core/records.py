"""Plain-data description of the checkpoints found under a root.

Everything that decides (retention, restore choice, schedule) works on these
records, never on storage or ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint directory (``step_<N>/``, ``checkpoint_<N>/`` or a path given explicitly).

    ``committed`` means ``manifest.json`` exists and parses; an uncommitted
    directory is an in-progress or torn save and is never loaded. ``step``
    comes from the manifest; ``label`` is the number in the directory's name
    (the step of an uncommitted directory, since it has no manifest).
    ``unreadable``: ``manifest.json`` could not be read (an I/O error, not its
    absence); whether the directory is committed is unknown, so nothing
    deletes it and restore warns when it passes it over.
    """

    step: int
    path: str
    committed: bool
    permanent: bool = False
    healthy: bool = True
    wall_time: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    world_size: Optional[int] = None
    epoch: Optional[int] = None
    total_bytes: int = 0
    num_files: int = 0
    problem: Optional[str] = None
    checkpoint_id: Optional[str] = None
    label: Optional[int] = None
    unreadable: bool = False


CheckpointInfo = CheckpointRecord
"""Public name for what ``CheckpointManager.list()``/``restore()`` return."""
