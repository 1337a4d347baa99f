"""What both framework adapters need from a training loop, in one place.

``LoopDriver`` wraps a ``CheckpointManager`` for a loop that a framework
drives: ``on_step`` records the loss (for the resume check) and saves when
due; save metrics produced on the core's background thread reach the
framework's loggers on the training thread (``drain``), and the alert
metrics (``ckpt/age_s``...) every ``alerts_every_n_steps``; ``restore`` takes the
newest valid checkpoint, one checkpoint directory (whatever its name), or
another root. The
helpers ``same_root`` and ``split_checkpoint_path`` are the one rule for
"which root is this" and "is this a checkpoint directory".
"""

from __future__ import annotations

import queue
from functools import partial
from typing import Any, Callable, Mapping, Optional

import torch

from .config import LOCAL_TIER_OFF, CheckpointSettings
from .errors import RestoreError
from .manager import CheckpointManager
from .records import CheckpointInfo
from .saver import SaveStats
from .state import TrainState
from .storage import MANIFEST_NAME, get_fs, join, parse_step_dirname

MetricsSink = Callable[[dict[str, float]], None]


def same_root(a: str, b: str, storage_options: Optional[Mapping[str, Any]] = None) -> bool:
    """Whether two paths or URLs name the same directory (same filesystem type, same normalised path)."""
    opts = dict(storage_options or {})
    (fa, pa), (fb, pb) = get_fs(str(a), **opts), get_fs(str(b), **opts)
    return type(fa) is type(fb) and pa.rstrip("/") == pb.rstrip("/")


def parent(url: str) -> str:
    """The directory holding ``url`` (``.`` for a bare name)."""
    url = str(url).rstrip("/")
    return url.rsplit("/", 1)[0] if "/" in url else "."


def split_checkpoint_path(path: str) -> tuple[str, Optional[int]]:
    """``(root, step)`` for a ``step_<N>``/``checkpoint_<N>`` directory, ``(path, None)`` for anything else."""
    path = str(path).rstrip("/")
    step = parse_step_dirname(path)
    return (parent(path), step) if step is not None else (path, None)


def checkpoint_target(path: str, storage_options: Optional[Mapping[str, Any]] = None) -> dict[str, str]:
    """``{"path": ...}`` when ``path`` is one checkpoint (``step_<N>``, or any directory holding a manifest),
    else ``{"root": ...}``: the arguments of ``LoopDriver.restore`` for a path a user gave."""
    path = str(path).rstrip("/")
    if parse_step_dirname(path) is not None:
        return {"path": path}
    fs, local = get_fs(path, **dict(storage_options or {}))
    return {"path": path} if fs.exists(join(local, MANIFEST_NAME)) else {"root": path}


def load_model_weights(model: Any, target: str, settings: CheckpointSettings) -> CheckpointInfo:
    """Load only the model weights of ``target`` (a checkpoint directory, or a root: its newest valid) into ``model``.

    For evaluation and inference: the same checks as a restore (checksums,
    the model's fingerprint, step and epoch), no optimizer, RNG or data
    position, and nothing under the root is moved. ``RestoreError`` when there
    is no usable checkpoint. Collective when a process group is initialized.
    """
    where = checkpoint_target(target, settings.storage_options)
    root = where.get("root") or split_checkpoint_path(where["path"])[0]
    if "path" in where and parse_step_dirname(where["path"]) is None:
        root = parent(where["path"])
    reader = settings.replace(dirpath=root, async_mode="off", handle_preemption=False, resume=True, resume_step=None,
                              every_n_steps=None, every_seconds=None, interval=None, **LOCAL_TIER_OFF)
    state = TrainState(model=model, rng=False)
    with CheckpointManager(settings=reader, env={}, argv=[]) as manager:
        rec = manager.restore(state, path=where.get("path"), set_aside_newer=False, weights_only=True)
    if rec is None:
        raise RestoreError(f"no committed checkpoint under {root}")
    return rec


def loss_value(loss: Any) -> Optional[float]:
    """A loss as a float (a tensor's mean), or None when there is none."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().mean().item())
    return float(loss)


def _relay(pending: "queue.SimpleQueue[dict[str, float]]", stats: SaveStats) -> None:
    pending.put(stats.as_metrics())  # may run on the core's retention thread; holds no reference to the driver


class LoopDriver:
    """A manager driven by a framework's hooks: step, metrics on the training thread, restore from anywhere."""

    def __init__(self, manager: CheckpointManager, sink: Optional[MetricsSink] = None,
                 alerts_every_n_steps: int = 50) -> None:
        self.manager = manager
        self._sink = sink
        self.alerts_every_n_steps = alerts_every_n_steps
        """Steps between two reports of the alert metrics (``ckpt/age_s``...) to the sink; 0: only with saves."""
        self._pending: "queue.SimpleQueue[dict[str, float]]" = queue.SimpleQueue()
        self.relay = partial(_relay, self._pending)
        """Queues the metrics of a save for ``drain``: a manager's metrics callback (any thread)."""
        if sink is not None:
            manager.add_metrics_callback(self.relay)

    def drain(self) -> None:
        """Hand the save metrics collected so far to the sink (call on the training thread)."""
        while self._sink is not None:
            try:
                metrics = self._pending.get_nowait()
            except queue.Empty:
                return
            self._sink(metrics)

    def on_step(self, step: int, state: TrainState, loss: Any = None,
                metrics: Optional[Mapping[str, float]] = None) -> bool:
        """One optimizer step done: record the loss when the resume check wants it, save when due."""
        manager = self.manager
        if loss is not None and manager.wants_loss(step):
            manager.record_loss(step, loss_value(loss))
        saved = manager.maybe_save(step, state, metrics=dict(metrics) if metrics else None)
        self.drain()
        every = self.alerts_every_n_steps
        if self._sink is not None and every > 0 and step % every == 0:
            self._sink(manager.alert_metrics())  # the age keeps growing between saves, and a stuck run shows it
        return saved

    def restore(self, state: TrainState, *, root: Optional[str] = None, step: Optional[int] = None,
                path: Optional[str] = None) -> Optional[CheckpointInfo]:
        """Restore exactly the checkpoint directory ``path``, or ``step`` (default: the newest valid) under ``root``.

        ``root`` defaults to the manager's. Another root is read with a
        temporary synchronous manager (no preemption handling, no background
        writer, no process groups of its own beyond DCP's), and nothing under
        it is moved or deleted. ``checkpoint_target`` turns a path a user
        gave into these arguments.
        """
        manager = self.manager
        if path is not None:  # exactly it (a rollback when it lies under the manager's root)
            return manager.restore(state, path=str(path).rstrip("/"))
        if root is None or same_root(root, manager.root, manager.settings.storage_options):
            return manager.restore(state, step=step)
        other = manager.settings.replace(dirpath=str(root), async_mode="off", handle_preemption=False, resume=True,
                                         resume_step=None, every_n_steps=None, every_seconds=None, interval=None,
                                         **LOCAL_TIER_OFF)
        with CheckpointManager(settings=other, env={}, argv=[]) as reader:
            return reader.restore(state, step=step, set_aside_newer=False)

    def finish(self) -> None:
        """Wait for the last save to commit and hand over its metrics."""
        self.manager.wait()
        self.drain()
