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
* ``accelerator.save_state()`` / ``load_state()`` are routed through the core;
* Accelerate's own counters (``accelerator.step``, every prepared loader's
  ``iteration`` i.e. its epoch, ``ProjectConfiguration.iteration``) and the
  objects given to ``register_for_checkpointing`` are part of the state;
* the core's save metrics go to ``accelerator.log``.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from ckpt_core import CheckpointInfo, CheckpointManager, CheckpointSettings, TrainState
from ckpt_core.config import log_effective_settings, resolve_entry_point  # CKPT_<NAME> env, --ckpt.<name> flags
from ckpt_core.ddp_layout import fix_bucket_layout
from ckpt_core.loop import LoopDriver, checkpoint_target, parent, same_root
from ckpt_core.storage import get_fs, join, step_dirname

from . import data as data_mod
from .counters import AcceleratedResumableLoader, AcceleratorCounters
from .tracking import TrainLoaderTracker

log = logging.getLogger("accelerate_ckpt")

_ACCELERATE_FORMAT_FILES = ("model.safetensors", "pytorch_model.bin", "random_states_0.pkl", "optimizer.bin")


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
        **kwargs: Any,
    ) -> None:
        code = dict(kwargs)
        if dirpath is not None:
            code["dirpath"] = os.fspath(dirpath)
        self.settings, self.sources = resolve_entry_point(code, settings, env=env, argv=argv)
        self.rebuild_dataloaders = rebuild_dataloaders
        self.log_metrics = log_metrics
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

    # ---------------------------------------------------------------- attach
    def attach(self, accelerator: Any) -> "CheckpointPlugin":
        """Bind to ``accelerator``: rebuild training loaders at ``prepare``, route ``save_state``/``load_state``.

        Call it before ``accelerator.prepare(...)`` so that the training loader
        is rebuilt as it is prepared (a loader prepared earlier is rebuilt when
        it is given to ``plugin.dataloader()`` or found by ``resume()``).
        """
        from accelerate.utils import DistributedType

        if self.accelerator is accelerator:
            return self
        if self.accelerator is not None:
            raise RuntimeError("this CheckpointPlugin is already attached to another Accelerator")
        if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise NotImplementedError(
                f"CheckpointPlugin does not support {accelerator.distributed_type}: its engines own their "
                "checkpoint format; use accelerator.save_state()/load_state() without the plugin")
        existing = getattr(accelerator, "checkpoint_plugin", None)
        if existing is not None and existing is not self:
            raise RuntimeError("this Accelerator already has another CheckpointPlugin attached")
        self.accelerator = accelerator
        self._loaders = TrainLoaderTracker(accelerator, self.rebuild_dataloaders)
        accelerator.checkpoint_plugin = self
        self._adopt_project_configuration(accelerator.project_configuration)
        for name in ("prepare_data_loader", "prepare_model", "save_state", "load_state", "end_training"):
            self._orig[name] = getattr(accelerator, name)
        if self.rebuild_dataloaders:
            accelerator.prepare_data_loader = self._prepare_data_loader
        accelerator.prepare_model = self._prepare_model
        fix_bucket_layout(*accelerator._models)  # models prepared before attach(), if no step has run yet
        accelerator.save_state = self._save_state
        accelerator.load_state = self._load_state
        accelerator.end_training = self._end_training
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
            self._manager = CheckpointManager(settings=self.settings, env={}, argv=[])
            self._driver = LoopDriver(self._manager, self._log_metrics)
        return self._manager

    @property
    def driver(self) -> LoopDriver:
        """The loop driver over ``manager`` (steps, metrics on the training thread, restores)."""
        self.manager  # noqa: B018 - creates the manager and its driver on first use
        return self._driver

    def _manager_for(self, root: Optional[str]) -> CheckpointManager:
        if root is None or same_root(root, self.settings.dirpath):
            return self.manager
        key = root.rstrip("/") or root
        if key not in self._extra_managers:
            self._extra_managers[key] = CheckpointManager(
                settings=self.settings.replace(dirpath=key), metrics_callbacks=[self.driver.relay], env={}, argv=[])
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
            self._after_save(self.settings.dirpath, self.global_step)
        return saved

    def save(self, step: Optional[int] = None, *, dirpath: Optional[str] = None,
             metrics: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """Save now (asynchronously), as checkpoint ``step`` (default: the current step). Collective.

        Returns the checkpoint's directory, or None when the save was skipped.
        When ``plugin.step()`` is not used (a script that only calls
        ``accelerator.save_state()``), checkpoints are numbered one after another.
        """
        self._check_attached()
        root = self.settings.dirpath if dirpath is None else os.fspath(dirpath)
        mgr = self._manager_for(root)
        key = _root_key(root, self.settings.dirpath)
        last = self._last_saved.get(key, -1)
        if step is None:
            step = self.global_step
            if self._step_calls == 0 and step <= last:
                step = last + 1  # no step counter in this script: number the saves
        step = int(step)
        path = join(mgr.root, step_dirname(step))
        if step == last:
            return path  # this step is already saved (by the schedule or an earlier call)
        self._drain_metrics()
        if not mgr.save(step, self.state(step), metrics=dict(metrics) if metrics else None):
            return None
        self._after_save(root, step)
        return path

    def _after_save(self, root: str, step: int) -> None:
        self._last_saved[_root_key(root, self.settings.dirpath)] = step
        self.accelerator.project_configuration.iteration += 1

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
                required: bool = True) -> Optional[CheckpointInfo]:
        """Restore checkpoint ``step`` (default: the newest valid) from ``dirpath`` (default: the plugin's root),
        or exactly the checkpoint directory ``path``."""
        self._check_attached()
        self._loaders.find()
        state = self.state()
        root = None if dirpath is None else os.fspath(dirpath)
        info = self.driver.restore(state, root=root, step=step, path=None if path is None else os.fspath(path))
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
        log.info("accelerate_ckpt: resumed from step %d (epoch %d) from %s", info.step, self.epoch, info.path)
        return info

    def wait(self) -> None:
        """Block until every in-flight save is committed and retention has run."""
        for mgr in self._managers():
            mgr.wait()
        self._drain_metrics()

    def _drain_metrics(self) -> None:
        if self._driver is not None:
            self._driver.drain()

    def close(self) -> None:
        """Flush the last save and release the core's resources. Safe to call twice."""
        try:
            for mgr in self._managers():
                mgr.close()
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
    def _save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                    **save_model_func_kwargs: Any) -> Optional[str]:
        """``accelerator.save_state`` through the core: async, committed last, retained.

        ``output_dir`` is a checkpoint *root* (default: the plugin's ``dirpath``);
        the checkpoint is ``<root>/step_<N>``. ``safe_serialization`` and engine
        keyword arguments do not apply (DCP shards are written).
        """
        step = save_model_func_kwargs.pop("step", None)
        if save_model_func_kwargs:
            log.info("accelerate_ckpt: save_state arguments %s do not apply to DCP checkpoints; ignored",
                     sorted(save_model_func_kwargs))
        return self.save(step, dirpath=None if output_dir is None else os.fspath(output_dir))

    def _load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                    **load_model_func_kwargs: Any) -> None:
        """``accelerator.load_state`` through the core.

        ``input_dir`` may be omitted (the newest valid checkpoint under the
        plugin's ``dirpath``), a checkpoint root (its newest valid checkpoint),
        or one ``step_<N>`` directory (exactly that checkpoint). A directory in
        Accelerate's own format is loaded by Accelerate's own ``load_state``.
        """
        if input_dir is None:
            self.restore(step=self.settings.resume_step)
            return
        path = os.fspath(input_dir).rstrip("/")
        fs, local = get_fs(path, **self.settings.storage_options)
        if not fs.exists(local):
            raise ValueError(f"Tried to find {path} but folder does not exist")
        if any(fs.exists(join(local, f)) for f in _ACCELERATE_FORMAT_FILES):
            log.info("accelerate_ckpt: %s is in Accelerate's own format; loading it with Accelerate's load_state",
                     path)
            self._orig["load_state"](input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
            return
        target = checkpoint_target(path, self.settings.storage_options)  # one checkpoint, or a root
        self.restore(path=target.get("path"), dirpath=target.get("root"))

    def _end_training(self) -> None:
        self.close()
        self._orig["end_training"]()


def _root_key(root: str, default: str) -> str:
    return "" if same_root(root, default) else root.rstrip("/")
