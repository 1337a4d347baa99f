"""``ckpt_path="last"`` on a trainer with ``DistributedCheckpoint``: the newest valid checkpoint of ours.

Lightning resolves ``"last"`` from ``ModelCheckpoint``'s ``.ckpt`` files
before any callback runs, and warns that there is none when only our callback
saves. With the callback on the trainer, ``"last"`` still means a
``ModelCheckpoint``'s last file when one exists; otherwise it means the
callback's root (its newest valid checkpoint), and one message says so.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ckpt_core.discovery import list_records

_ORIGINAL: Optional[Callable[..., Any]] = None


def install() -> None:
    """Wrap Lightning's ``ckpt_path`` resolution once per process (a no-op for trainers without the callback)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = _CheckpointConnector._parse_ckpt_path
        _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path


def _parse_ckpt_path(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, model_provided: bool,
                     model_connected: bool) -> Any:
    ours = next((cb for cb in self.trainer.callbacks if hasattr(cb, "last_checkpoint_root")), None)
    if ours is None or ckpt_path != "last":
        return _ORIGINAL(self, state_fn, ckpt_path, model_provided, model_connected)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available")
        path = _ORIGINAL(self, state_fn, ckpt_path, model_provided, model_connected)
    if path is not None:
        return path  # a ModelCheckpoint's last .ckpt: Lightning's own meaning
    root = ours.last_checkpoint_root()
    fn = getattr(state_fn, "value", state_fn)
    if root is None:
        rank_zero_info(f"DistributedCheckpoint: {fn}(ckpt_path='last') uses the newest valid checkpoint under the "
                       "callback's dirpath, which is known once the trainer is set up")
        return None
    if not list_records(root, ours.settings.storage_options):
        rank_zero_info(f"DistributedCheckpoint: {fn}(ckpt_path='last'): no checkpoint under {root} yet")
        return None
    rank_zero_info(f"DistributedCheckpoint: {fn}(ckpt_path='last') uses the newest valid checkpoint under {root}")
    return root
