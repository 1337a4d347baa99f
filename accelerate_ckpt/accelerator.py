"""``Accelerator`` that takes ``checkpoint_plugin=`` like it takes ``fsdp_plugin=``.

Accelerate has no generic plugin slot (``kwargs_handlers`` rejects unknown
handler classes), so this subclass adds one keyword; everything else is
``accelerate.Accelerator``. Code that builds its own ``Accelerator`` uses
``CheckpointPlugin.attach(accelerator)`` instead: the same implementation.
"""

from __future__ import annotations

from typing import Any, Optional

import accelerate

from .plugin import CheckpointPlugin


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` plus ``checkpoint_plugin=CheckpointPlugin(...)``."""

    def __init__(self, *args: Any, checkpoint_plugin: Optional[CheckpointPlugin] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_plugin: Optional[CheckpointPlugin] = None
        if checkpoint_plugin is not None:
            if not isinstance(checkpoint_plugin, CheckpointPlugin):
                raise TypeError(f"checkpoint_plugin must be a CheckpointPlugin, got {type(checkpoint_plugin).__name__}")
            checkpoint_plugin.attach(self)
