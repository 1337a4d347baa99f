"""``CheckpointPlugin``: fault-tolerant checkpointing for a Hugging Face ``Accelerator``.

A thin adapter: it translates the accelerator's prepared objects into a
``ckpt_core.TrainState`` and calls a ``ckpt_core.CheckpointManager`` at the
training loop's step boundaries. Everything real (async sharded saves, the
commit protocol, retention, discovery with fallback, resharding, RNG policy,
preemption) lives in the core.

What the adapter itself adds is Accelerate-specific:

* training data loaders are rebuilt on ``ResumableDistributedSampler`` when
  prepared (``accelerate_ckpt.data``), so the data position is global and
  survives a change of the process count;
* ``accelerator.save_state()`` / ``load_state()`` keep stock Accelerate's meaning
  (a checkpoint *at* the directory given, complete when ``save_state`` returns)
  and go through the core (``accelerate_ckpt.state_calls``);
* Accelerate's own counters (``accelerator.step``, every prepared loader's
  ``iteration`` i.e. its epoch, ``ProjectConfiguration.iteration``) and the
  objects given to ``register_for_checkpointing`` are part of the state;
* the core's save metrics go to ``accelerator.log``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

from torch import nn

from ckpt_core import CheckpointInfo, CheckpointManager, CheckpointSettings, SaveStats, TrainState
from ckpt_core.config import LOCAL_TIER_OFF, log_effective_settings, resolve_entry_point  # CKPT_<NAME> env, --ckpt.<name> flags
from ckpt_core.ddp_layout import fix_bucket_layout
from ckpt_core.loop import LoopDriver, parent, same_root
from ckpt_core.storage import join, step_dirname

from . import data as data_mod
from . import state_calls
from .counters import AcceleratedResumableLoader, AcceleratorCounters
from .support import check_supported
from .tracking import TrainLoaderTracker

log = logging.getLogger("accelerate_ckpt")



class CheckpointPlugin:
    """Fault-tolerant, asynchronous, sharded checkpoints for an ``Accelerator``.

    Use it either as ``accelerate_ckpt.Accelerator(checkpoint_plugin=plugin)``
    or, for code that builds its own ``Accelerator``, ``plugin.attach(accelerator)``
    *before* ``accelerator.prepare(...)``.

    Args:
        dirpath: checkpoint root (local path or fsspec URL).
        settings: a full ``CheckpointSettings`` to start from.
        env: where ``CKPT_<NAME>`` variables are read (default ``os.environ``; ``{}`` reads none).
        argv: where ``--ckpt.<name>`` flags are read (default ``sys.argv[1:]``; ``[]`` reads none).
        rebuild_dataloaders: rebuild shuffled map-style training loaders on
            ``ResumableDistributedSampler`` when they are prepared (default True).
        log_metrics: send the core's save metrics to ``accelerator.log`` when trackers are configured.
        log_every_n_steps: steps between two reports of the alert metrics (``ckpt/age_s``,
            ``ckpt/failed_saves``, ``ckpt/fallbacks``) through ``plugin.step()`` (0: only with saves).
        async_save_state: let ``accelerator.save_state()`` return once the state is staged, as
            ``plugin.step()`` saves do, instead of once the checkpoint is committed on every rank.
        **kwargs: any ``CheckpointSettings`` field (``every_n_steps``, ``keep_last``, ...).

    Precedence: defaults < ``settings`` < keyword arguments < ``CKPT_*`` env < ``--ckpt.*`` flags.
    """

    def __init__(
        self,
        dirpath: Optional[str | os.PathLike] = None,
        *,
        settings: Optional[CheckpointSettings] = None,
        env: Optional[Mapping[str, str]] = None,
        argv: Optional[Sequence[str]] = None,
        rebuild_dataloaders: bool = True,
        log_metrics: bool = True,
        log_every_n_steps: int = 50,
        async_save_state: bool = False,
        **kwargs: Any,
    ) -> None:
        code = dict(kwargs)
        if dirpath is not None:
            code["dirpath"] = os.fspath(dirpath)
        self.settings, self.sources = resolve_entry_point(code, settings, env=env, argv=argv)
        self.rebuild_dataloaders = rebuild_dataloaders
        self.log_metrics = log_metrics
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be a non-negative int, got {log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self.async_save_state = async_save_state
        self.accelerator: Any = None
        self.global_step = 0
        self.resumed_from: Optional[int] = None
        self._epoch = 0
        self._manager: Optional[CheckpointManager] = None
        self._extra_managers: dict[str, CheckpointManager] = {}
        self._last_saved: dict[str, int] = {}
        self._loaders: Optional[TrainLoaderTracker] = None
        self._step_calls = 0
        self._driver: Optional[LoopDriver] = None
        self._orig: dict[str, Any] = {}
        self._writing: dict[str, tuple[int, str, Optional[str]]] = {}  # root key -> (step, path, what it replaces)

    # ---------------------------------------------------------------- attach
    def attach(self, accelerator: Any) -> "CheckpointPlugin":
        """Bind to ``accelerator``: rebuild training loaders at ``prepare``, route ``save_state``/``load_state``.

        Call it before ``accelerator.prepare(...)`` so that the training loader
        is rebuilt as it is prepared (a loader prepared earlier is rebuilt when
        it is given to ``plugin.dataloader()`` or found by ``resume()``).
        """
        if self.accelerator is accelerator:
            return self
        if self.accelerator is not None:
            raise RuntimeError("this CheckpointPlugin is already attached to another Accelerator")
        check_supported(accelerator)
        existing = getattr(accelerator, "checkpoint_plugin", None)
        if existing is not None and existing is not self:
            raise RuntimeError("this Accelerator already has another CheckpointPlugin attached")
        self.accelerator = accelerator
        self._loaders = TrainLoaderTracker(accelerator, self.rebuild_dataloaders)
        accelerator.checkpoint_plugin = self
        self._adopt_project_configuration(accelerator.project_configuration)
        for name in ("prepare_data_loader", "prepare_model", "save_state", "load_state", "end_training",
                     "skip_first_batches"):
            self._orig[name] = getattr(accelerator, name)
        if self.rebuild_dataloaders:
            accelerator.prepare_data_loader = self._prepare_data_loader
        accelerator.prepare_model = self._prepare_model
        fix_bucket_layout(*accelerator._models)  # models prepared before attach(), if no step has run yet
        accelerator.save_state = functools.partial(state_calls.save_state, self)
        accelerator.load_state = functools.partial(state_calls.load_state, self)
        accelerator.end_training = self._end_training
        accelerator.skip_first_batches = self._skip_first_batches
        state_calls.register(self)
        if accelerator.is_main_process:
            log_effective_settings(self.settings, self.sources, logger=log)
        return self

    def _adopt_project_configuration(self, pc: Any) -> None:
        """With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` and no explicit settings,
        checkpoints go where ``save_state()`` put them (``<project_dir>/checkpoints``) and ``total_limit``
        becomes ``keep_last``."""
        if not getattr(pc, "automatic_checkpoint_naming", False):
            return
        changes: dict[str, Any] = {}
        if self.sources.get("dirpath", "default") == "default" and pc.project_dir:
            changes["dirpath"] = os.path.join(pc.project_dir, "checkpoints")
        if self.sources.get("keep_last", "default") == "default" and pc.total_limit is not None:
            changes["keep_last"] = int(pc.total_limit)
        if changes:
            self.settings = self.settings.replace(**changes)
            self.sources.update({k: "accelerator.project_configuration" for k in changes})

    def _check_attached(self) -> Any:
        if self.accelerator is None:
            raise RuntimeError("CheckpointPlugin is not attached: pass it as Accelerator(checkpoint_plugin=...) "
                               "or call plugin.attach(accelerator) first")
        return self.accelerator

    # -------------------------------------------------------------- managers
    @property
    def manager(self) -> CheckpointManager:
        """The core manager for ``settings.dirpath`` (created at first use, on every rank together)."""
        self._check_attached()
        if self._manager is None:
            if not self.settings.dirpath:
                raise ValueError("CheckpointPlugin has no dirpath: pass CheckpointPlugin(dirpath=...) (or set "
                                 "CKPT_DIRPATH, or ProjectConfiguration(automatic_checkpoint_naming=True)) to "
                                 "save with plugin.step()/save() or load the newest checkpoint")
            self._manager = CheckpointManager(settings=self.settings, env={}, argv=[],
                                              metrics_callbacks=[_on_commit(self, "")])
            self._driver = LoopDriver(self._manager, self._log_metrics, self.log_every_n_steps)
        return self._manager

    @property
    def driver(self) -> LoopDriver:
        """The loop driver over ``manager`` (steps, metrics on the training thread, restores)."""
        self.manager  # noqa: B018 - creates the manager and its driver on first use
        return self._driver

    def _manager_for(self, root: Optional[str]) -> CheckpointManager:
        """The manager of ``root``: the plugin's own, or one for a directory ``save_state``/``load_state`` named
        (no retention there, no signal handlers: stock ``save_state(dir)`` deletes nothing)."""
        if root is None or (self.settings.dirpath and same_root(root, self.settings.dirpath)):
            return self.manager
        key = _root_key(root, self.settings.dirpath)
        if key not in self._extra_managers:
            settings = self.settings.replace(dirpath=key, keep_last=None, keep_every_n_steps=None,
                                             keep_every_seconds=None, keep_best=None, handle_preemption=False,
                                             **LOCAL_TIER_OFF)
            self._extra_managers[key] = CheckpointManager(settings=settings, env={}, argv=[],
                                                          metrics_callbacks=[_on_commit(self, key)])
        return self._extra_managers[key]

    def _managers(self) -> list[CheckpointManager]:
        return ([self._manager] if self._manager is not None else []) + list(self._extra_managers.values())

    # ----------------------------------------------------------------- state
    @property
    def epoch(self) -> int:
        """The training loader's epoch (restored by ``resume()``)."""
        epoch = self._loaders.epoch() if self._loaders is not None else None
        return self._epoch if epoch is None else epoch

    def state(self, step: Optional[int] = None) -> TrainState:
        """The ``TrainState`` of everything the accelerator prepared (built fresh; cheap)."""
        acc = self._check_attached()
        models = list(acc._models)
        if len(models) == 1:
            model: Optional[nn.Module] = models[0]
        elif models:
            model = nn.ModuleDict({str(i): m for i, m in enumerate(models)})
        else:
            model = None
        optimizers = [getattr(o, "optimizer", o) for o in acc._optimizers]
        schedulers = [getattr(s, "scheduler", s) for s in acc._schedulers]
        extra: dict[str, Any] = {"accelerate": AcceleratorCounters(acc)}
        extra.update({f"custom_{i}": obj for i, obj in enumerate(acc._custom_objects)})
        return TrainState(
            model=model,
            optimizers=optimizers or None,
            schedulers=schedulers or None,
            scaler=acc.scaler,
            dataloader=self._loaders.for_state(),
            step=self.global_step if step is None else step,
            epoch=self.epoch,
            extra=extra,
        )

    def _prepare_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """``accelerator.prepare_model``, then DDP's bucket layout fixed before the first step (exact resume)."""
        prepared = self._orig["prepare_model"](model, *args, **kwargs)
        fix_bucket_layout(prepared)
        return prepared

    # ------------------------------------------------------------ data loaders
    def _prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                             slice_fn_for_dispatch: Any = None) -> Any:
        """``accelerator.prepare_data_loader`` with shuffled map-style loaders rebuilt on the resumable sampler."""
        acc = self.accelerator
        if (not getattr(data_loader, "_is_accelerate_prepared", False) and data_mod.is_shuffled(data_loader)
                and data_mod.why_not_rebuildable(data_loader, acc) is None):
            prepared = data_mod.rebuild(acc, data_loader, device_placement)
            acc._dataloaders.append(prepared)
            return prepared
        return self._orig["prepare_data_loader"](
            data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch)

    def dataloader(self, dataloader: Any) -> AcceleratedResumableLoader:
        """Iterate the training loader through this: counts consumed batches, continues mid-epoch after a resume.

        Call it in the loop header every epoch (``for batch in plugin.dataloader(dl):``);
        it returns the same wrapper each time.
        """
        self._check_attached()
        return self._loaders.wrapper(dataloader)

    # ------------------------------------------------------------ train loop
    def step(self, loss: Any = None, metrics: Optional[Mapping[str, float]] = None) -> bool:
        """End of one training batch: count the optimizer step and save when due. Returns whether a save started.

        Batches inside a gradient-accumulation window (``accelerator.sync_gradients``
        False) are not steps: no save happens while gradients are half accumulated.
        ``loss`` (rank 0's) feeds the core's resume check. On a preemption
        signal this saves, waits and raises ``ckpt_core.Preempted`` (``SystemExit``).
        """
        acc = self._check_attached()
        self._step_calls += 1
        self._drain_metrics()
        if not acc.sync_gradients:
            return False
        self.global_step += 1
        saved = self.driver.on_step(self.global_step, self.state(), loss=loss, metrics=metrics)
        if saved:
            self._started("", self.global_step, join(self.manager.root, step_dirname(self.global_step)), None)
        return saved

    def save(self, step: Optional[int] = None, *, dirpath: Optional[str] = None,
             metrics: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """Save now (asynchronously), as checkpoint ``step`` (default: the current step). Collective.

        Returns the checkpoint's directory (``<dirpath>/step_<N>``), or None when the save was skipped.
        When ``plugin.step()`` is not used (a script that only calls
        ``accelerator.save_state()``), checkpoints are numbered one after another.
        """
        self._check_attached()
        root = self.settings.dirpath if dirpath is None else os.fspath(dirpath)
        mgr = self._manager_for(root)
        key = _root_key(root, self.settings.dirpath)
        step = self._step_for(key, step)
        path = join(mgr.root, step_dirname(step))
        if step == self._last_saved.get(key, -1):
            return path  # this step is already saved (by the schedule or an earlier call)
        self._drain_metrics()
        if not mgr.save(step, self.state(step), metrics=dict(metrics) if metrics else None):
            return None
        self._started(key, step, path, None)
        return path

    def save_at(self, path: str, step: Optional[int] = None, *, automatic: bool = False,
                metrics: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """Save checkpoint ``step`` exactly at the directory ``path``, whatever its name (collective).

        What ``path`` held is moved aside and deleted once the new checkpoint is
        committed; ``automatic`` (``checkpoint_<i>`` naming) refuses a committed
        checkpoint there, as stock Accelerate does.
        """
        self._check_attached()
        path = os.fspath(path).rstrip("/")
        root, name = parent(path), path.rsplit("/", 1)[-1]
        mgr = self._manager_for(root)
        key = _root_key(root, self.settings.dirpath)
        step = self._step_for(key, step)
        self._drain_metrics()
        aside = state_calls.make_room(self, path, automatic)
        if not mgr.save(step, self.state(step), metrics=dict(metrics) if metrics else None, name=name):
            state_calls.put_back(self, aside, path)
            return None
        self._started(key, step, path, aside)
        return path

    def _step_for(self, key: str, step: Optional[int]) -> int:
        """``step``, or the current step; numbered after the last save when ``plugin.step()`` is not used."""
        last = self._last_saved.get(key, -1)
        if step is None:
            step = self.global_step
            if self._step_calls == 0 and step <= last:
                step = last + 1
        return int(step)

    def _started(self, key: str, step: int, path: str, aside: Optional[str]) -> None:
        self._last_saved[key] = step
        self._writing[key] = (step, path, aside)
        self.accelerator.project_configuration.iteration += 1

    def _committed(self, key: str, stats: SaveStats) -> None:
        """A save of root ``key`` committed (rank 0: after retention): drop what it replaced."""
        step, path, aside = self._writing.get(key, (None, None, None))
        if stats.committed and step == stats.step:  # failed saves are reported too (ckpt/failed_saves)
            self._writing.pop(key, None)
            state_calls.drop_aside(self, aside)

    def writing_paths(self) -> list[str]:
        """Checkpoint directories this plugin's saves may still be writing."""
        return [path for _, path, _ in list(self._writing.values())]

    def resume(self) -> Optional[CheckpointInfo]:
        """Restore the newest valid checkpoint (or ``resume_step``) into everything prepared; None when there is none.

        Call it after ``accelerator.prepare(...)`` and before the training loop.
        Does nothing (returns None) when the ``resume`` setting is false.
        """
        self._check_attached()
        if not self.settings.resume:
            return None
        return self.restore(step=self.settings.resume_step, required=False)

    def restore(self, step: Optional[int] = None, *, dirpath: Optional[str] = None, path: Optional[str] = None,
                required: bool = True, set_aside_newer: bool = True) -> Optional[CheckpointInfo]:
        """Restore checkpoint ``step`` (default: the newest valid) from ``dirpath`` (default: the plugin's root),
        or exactly the checkpoint directory ``path`` (under the plugin's root a rollback: newer checkpoints are
        moved to ``rolled_back/`` unless ``set_aside_newer=False``)."""
        self._check_attached()
        self._loaders.find()
        state = self.state()
        root = None if dirpath is None else os.fspath(dirpath)
        if path is not None:
            path = os.fspath(path).rstrip("/")
            info = self._manager_for(parent(path)).restore(state, path=path, set_aside_newer=set_aside_newer)
        elif root is not None and not (self.settings.dirpath and same_root(root, self.settings.dirpath)):
            info = self._manager_for(root).restore(state, step=step, set_aside_newer=False)  # read, move nothing
        else:
            info = self.driver.restore(state, step=step)
        if info is None:
            if required:
                raise FileNotFoundError(f"no committed checkpoint under {root or self.manager.root}")
            return None
        self.global_step = state.step
        self._epoch = state.epoch
        self.resumed_from = info.step
        self._last_saved[_root_key(parent(info.path), self.settings.dirpath)] = info.step
        if self._loaders.train_loader is None and self.accelerator._dataloaders and not self._loaders.warned_no_position:
            warnings.warn("accelerate_ckpt: no training data loader was found to restore the data position into; "
                          "call plugin.dataloader(train_dataloader) before plugin.resume()", stacklevel=3)
        self._notice(f"accelerate_ckpt: resumed from step {info.step} (epoch {self.epoch}) at {info.path}, saved "
                     f"by {info.world_size} process(es), now {self.accelerator.num_processes}")
        return info

    def _notice(self, message: str) -> None:
        """One line on the main process, visible without any logging configuration (and in the log)."""
        log.info(message)
        if self.accelerator.is_main_process:
            print(message, file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Block until every in-flight save is committed and retention has run."""
        try:
            for mgr in self._managers():
                mgr.wait()
        finally:
            self._writing.clear()  # committed (and what they replaced dropped), or failed: nothing writing
            self._drain_metrics()

    def _drain_metrics(self) -> None:
        if self._driver is not None:
            self._driver.drain()

    def close(self, completed: bool = False) -> None:
        """Flush the last save and release the core's resources. Safe to call twice.

        ``completed``: training ended without error (``accelerator.end_training()`` says so), so the local
        tier's snapshots of this job are removed (``local_cleanup``).
        """
        try:
            for mgr in self._managers():
                mgr.close(completed=completed)
        finally:
            self._drain_metrics()

    # -------------------------------------------------------------- metrics
    def _log_metrics(self, metrics: dict[str, float]) -> None:
        acc = self.accelerator
        if self.log_metrics and acc is not None and getattr(acc, "trackers", None):
            try:
                acc.log(metrics, step=self.global_step)
            except Exception as e:  # noqa: BLE001 - logging must not break training
                log.warning("accelerate_ckpt: could not log checkpoint metrics: %s", e)

    # ---------------------------------------------- accelerator method overrides
    def _skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``accelerator.skip_first_batches``; a pass over the result also ends the original loader's epoch."""
        skipping = self._orig["skip_first_batches"](dataloader, num_batches=num_batches)
        if hasattr(dataloader, "iteration") and hasattr(skipping, "iteration"):
            data_mod.follow_epochs(skipping, dataloader)
        return skipping

    def _end_training(self) -> None:
        self.close(completed=True)
        self._orig["end_training"]()


def _root_key(root: str, default: Optional[str]) -> str:
    return "" if default and same_root(root, default) else root.rstrip("/")


def _on_commit(plugin: CheckpointPlugin, key: str) -> Callable[[SaveStats], None]:
    """A manager's metrics callback that reaches ``plugin`` without keeping it alive (no reference cycle)."""
    ref = weakref.ref(plugin)

    def committed(stats: SaveStats) -> None:
        owner = ref()
        if owner is None:
            return
        owner._committed(key, stats)
        if key and owner._driver is not None:
            owner._driver.relay(stats)

    return committed
