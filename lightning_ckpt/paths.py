"""Where Lightning's checkpoints go by default, and which paths are checkpoints of ours."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ckpt_core.discovery import list_records
from ckpt_core.loop import parent
from ckpt_core.storage import get_fs, parse_step_dirname


def default_dirpath(trainer: "pl.Trainer") -> str:
    """Like ``ModelCheckpoint``: ``<logger save_dir>/<name>/<version>/checkpoints``, else ``<default_root_dir>/checkpoints``.

    The same on every rank (rank 0's, broadcast); warns when an earlier logger version holds checkpoints this run
    will not resume from.
    """
    logger_dir = None
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        logger_dir = os.path.join(str(save_dir), str(logger.name))
        path = os.path.join(logger_dir, version, "checkpoints")
    else:
        path = os.path.join(str(trainer.default_root_dir), "checkpoints")
    path = trainer.strategy.broadcast(path)
    if logger_dir is not None and trainer.is_global_zero:
        _warn_if_earlier_versions(logger_dir, path)
    return path


def is_ours(path: Any) -> bool:
    """Whether ``path`` is one of our step directories or a root holding some."""
    try:
        path = os.fspath(path)
        fs, p = get_fs(path)
        if parse_step_dirname(str(path).rstrip("/")) is not None:
            return fs.isdir(p)
        return fs.isdir(p) and bool(list_records(path))
    except Exception:  # noqa: BLE001 - not a path we can read: leave it to Lightning
        return False


def _warn_if_earlier_versions(logger_dir: str, path: str) -> None:
    """Warn when the default dirpath (a new logger version) misses checkpoints of an earlier version."""
    try:
        if list_records(path):
            return
        fs, p = get_fs(logger_dir)
        earlier = sorted(fs.glob(f"{p.rstrip('/')}/*/checkpoints/step_*"))
    except Exception:  # noqa: BLE001 - a hint only
        return
    if earlier:
        rank_zero_warn(f"DistributedCheckpoint: this run saves to {path} (the logger's new version), but "
                       f"{parent(earlier[-1])} holds checkpoints of an earlier run that this run does not resume "
                       "from; to resume across restarts set the root: DistributedCheckpoint(dirpath=...), "
                       "--trainer.callbacks.dirpath=... with LightningCLI, or CKPT_DIRPATH=...")
