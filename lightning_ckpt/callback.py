"""``DistributedCheckpoint``: async sharded checkpoints, exact resume and recovery for a Lightning ``Trainer``.

A thin adapter: Lightning's objects become a ``ckpt_core.TrainState``, its
hooks become ``CheckpointManager`` calls, the manager's metrics go to the
trainer's loggers. Where each piece happens:

``setup`` (fit)
    resolve ``dirpath``, build the ``CheckpointManager``, wrap the train data
    source (``lightning_ckpt.data``) and intercept ``fit(ckpt_path=...)`` for
    checkpoint directories of ours.
``on_fit_start`` (optimizers and the wrapped model exist)
    build the ``TrainState`` and restore: ``ckpt_path`` if it names one of our
    checkpoints, else the newest valid checkpoint under ``dirpath``. Strategies
    that restore after setup get the same restore when Lightning starts its own.
``on_train_batch_end`` (on batches where the optimizer stepped)
    record the loss, save when due (``maybe_save``: also the preemption check).
``on_exception``
    wait for the save in flight, and with ``save_on_exception`` save one more
    checkpoint when every rank reached this point at a step boundary.
``on_train_end`` / ``teardown``
    flush (commit) the last save and release the manager.
"""

from __future__ import annotations

import logging
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ckpt_core import CheckpointManager, CheckpointSettings, Preempted, TrainState, rng
from ckpt_core.config import log_effective_settings, resolve_entry_point, schema
from ckpt_core.coordination import all_ranks_agree
from ckpt_core.ddp_layout import fix_bucket_layout
from ckpt_core.loop import LoopDriver, checkpoint_target, load_model_weights

from .data import NONE, ResumableTrainLoader, install_source
from . import last, slurm
from .paths import default_dirpath, is_ours
from .state import LightningTrainerState, validation_follows

log = logging.getLogger("lightning_ckpt")
last.install()


class DistributedCheckpoint(Checkpoint):
    """Asynchronous sharded checkpoints with exact mid-epoch resume and automatic recovery.

    Every rank writes its own shards (``torch.distributed.checkpoint``) in the
    background; training stalls only for the copy into host memory. A
    checkpoint holds the model and optimizer state (sharded), LR schedulers,
    the precision plugin (grad scaler), Lightning's loop progress, other
    callbacks' and the datamodule's states, the training data position and
    every rank's RNG states. ``trainer.fit`` resumes by itself from the newest
    valid checkpoint under ``dirpath`` (skipping corrupt ones), also at
    another world size (resharding).

    Example::

        trainer = L.Trainer(callbacks=[DistributedCheckpoint(dirpath="s3://bucket/run1",
                                                             every_n_train_steps=500, keep_last=3)])
        trainer.fit(model, datamodule)  # resumes when dirpath holds a valid checkpoint

    Args:
        dirpath: Checkpoint root: a local path or any fsspec URL (``s3://``, ``gs://``, ``memory://``).
            Default: like ``ModelCheckpoint``, ``<logger save_dir>/<name>/<version>/checkpoints`` with a logger,
            else ``<default_root_dir>/checkpoints``. A restarted job resumes only from the same ``dirpath``:
            pass one explicitly when the logger's version changes between runs.
        every_n_train_steps: Save every N optimizer steps (``global_step % N == 0``).
        train_time_interval: Save when this much wall time passed since the last save (rank 0's clock).
        save_on_exception: On an exception (also Lightning's ``SIGTERMException``), save one more checkpoint
            when the state is at a step boundary and every rank reached the exception handler.
        keep_last: Keep the newest K checkpoints (``None`` keeps all). The newest valid one is never deleted.
        keep_every_n_steps: Also keep, permanently, the checkpoints at multiples of N steps.
        keep_best: ``(metric, "min"|"max", n)``: also keep the n best checkpoints by a logged metric.
        interval: ``"auto"``: the Young/Daly interval from the measured save stall and the failure rate
            (needs ``device_mtbf_hours``; chosen automatically when that is given alone).
        device_mtbf_hours: Mean time between failures of one device, in hours (for ``interval="auto"``).
        async_mode: ``"bytes"`` (the default: DCP serializes on a thread, a small process without torch
            writes the bytes; no process group needed on one device), ``"process"`` (DCP's background
            process), ``"thread"`` or ``"off"`` (blocking).
        verify: Check a checkpoint before loading it: ``"none"``, ``"size"`` or ``"checksum"``.
        resume: Restore the newest valid checkpoint under ``dirpath`` when ``fit`` starts.
        resume_step: Restore exactly this step instead (a rollback: newer checkpoints are moved aside).
        handle_preemption: On SIGTERM/SIGUSR1, save at the next step boundary on every rank and exit with
            code 143 (``ckpt_core.Preempted``), before Lightning's own SIGTERM handling stops the run.
        exception_timeout_s: How long ranks wait for each other before an exception checkpoint.
        local_every_n_train_steps: Local tier: also snapshot every N steps into node memory (``local_dir``),
            replicated to a peer node; a restart resumes from it when it is newer than ``dirpath``'s newest.
        local_dir: Local tier: the node-local directory of snapshots (default ``/dev/shm/ckpt-<uid>``).
        settings: Further ``ckpt_core.CheckpointSettings`` (``writer_threads``, ``storage_options``,
            ``on_save_error``, ``max_host_memory_bytes``...); the arguments above that are given take precedence.
        env: where ``CKPT_<NAME>`` variables are read (default ``os.environ``; ``{}`` reads none).
        argv: where ``--ckpt.<name>`` flags are read (default ``sys.argv[1:]``; ``[]`` reads none).

    Precedence: defaults < ``settings`` < the arguments given < ``CKPT_*`` env < ``--ckpt.*`` flags; an unknown
    ``CKPT_`` variable (a misspelt name) is an error naming the closest setting.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        save_on_exception: bool = False,
        keep_last: Optional[int] = None,
        keep_every_n_steps: Optional[int] = None,
        keep_best: Optional[tuple[str, str, int]] = None,
        interval: Optional[str] = None,
        device_mtbf_hours: Optional[float] = None,
        async_mode: Optional[str] = None,
        verify: Optional[str] = None,
        resume: Optional[bool] = None,
        resume_step: Optional[int] = None,
        handle_preemption: Optional[bool] = None,
        exception_timeout_s: float = 30.0,
        local_every_n_train_steps: Optional[int] = None,
        local_dir: Optional[Union[str, Path]] = None,
        settings: Optional[CheckpointSettings] = None,
        env: Optional[Mapping[str, str]] = None,
        argv: Optional[Sequence[str]] = None,
    ) -> None:
        super().__init__()
        self.dirpath = None if dirpath is None else str(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.train_time_interval = train_time_interval
        self.save_on_exception = save_on_exception
        self.exception_timeout_s = float(exception_timeout_s)
        if interval is None and device_mtbf_hours is not None:
            interval = "auto"
        given = dict(
            dirpath=self.dirpath,
            every_n_steps=every_n_train_steps,
            every_seconds=None if train_time_interval is None else train_time_interval.total_seconds(),
            interval=interval,
            device_mtbf_hours=device_mtbf_hours,
            keep_last=keep_last,
            keep_every_n_steps=keep_every_n_steps,
            keep_best=None if keep_best is None else tuple(keep_best),
            async_mode=async_mode,
            verify=verify,
            resume=resume,
            resume_step=resume_step,
            handle_preemption=handle_preemption,
            local_every_n_steps=local_every_n_train_steps,
            local_dir=None if local_dir is None else str(local_dir),
        )
        code = {k: v for k, v in given.items() if v is not None}  # an argument left out does not override settings
        self._given_settings = settings
        self.settings, self.sources = resolve_entry_point(code, settings, env=env, argv=argv)
        self.manager: Optional[CheckpointManager] = None
        self.state: Optional[TrainState] = None
        self.resumed_from: Optional[int] = None
        """The step this ``fit`` restored, or None when it started fresh."""
        self._reset_run()

    def _reset_run(self) -> None:
        self.state = None
        self.resumed_from = None
        self._source: Any = None
        self._connector_patched: Any = None
        self._requested: Optional[str] = None
        self._lightning_ckpt: Optional[str] = None
        self._restored = False
        self._last_step = -1
        self._start_step = 0
        self._boundary: Optional[tuple[int, int]] = None
        self._val_rng: Optional[dict] = None
        self._pending: Optional[tuple[int, Any]] = None  # (step, loss) whose save waits for its validation
        self._validating_in_fit = False
        self._driver: Optional[LoopDriver] = None
        self._completed = False  # training ended without an exception: the local tier's snapshots can go

    def _runtime_settings(self, trainer: "pl.Trainer") -> CheckpointSettings:
        """The resolved settings, with what only the trainer knows (the default dirpath) filled in where nothing
        set it."""
        if self._unset("dirpath"):
            return self.settings.replace(dirpath=default_dirpath(trainer))
        return self.settings

    def _unset(self, name: str) -> bool:
        """Whether no argument, ``settings`` value, variable or flag chose setting ``name``."""
        given = self._given_settings
        return self.sources[name] == "default" and (given is None or getattr(given, name) == schema()[name].default)

    def last_checkpoint_root(self) -> Optional[str]:
        """The root ``ckpt_path="last"`` refers to, when it is known before the trainer is set up (``last.py``)."""
        return None if self._unset("dirpath") else self.settings.dirpath

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            self._patch_evaluation(trainer)
            return
        self._reset_run()
        self.settings = self._runtime_settings(trainer)
        if self.settings.async_mode == "process" and trainer.world_size == 1:
            rank_zero_warn("DistributedCheckpoint(async_mode='process') on one device starts a 1-rank gloo process "
                           "group, so torch.distributed reports itself initialized to Lightning and other libraries;"
                           " async_mode='bytes' (the default) avoids that")
        self.manager = CheckpointManager(settings=self.settings, env={}, argv=[])
        if trainer.is_global_zero:
            # a child of Lightning's logger: shown at Lightning's default level, next to its own start-up lines
            log_effective_settings(self.settings, self.sources, logger=logging.getLogger("lightning.pytorch.ckpt"))

        def log_metrics(metrics: dict[str, float]) -> None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

        self._driver = LoopDriver(self.manager, log_metrics if trainer.is_global_zero else None,
                                  alerts_every_n_steps=trainer.log_every_n_steps)  # Lightning's own cadence
        # Last of all callbacks: a save after validation holds what ModelCheckpoint, EarlyStopping and the
        # rest recorded in their own on_validation_end. A new list: Lightning is iterating the current one.
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]
        if not any(getattr(self.settings, k) for k in ("every_n_steps", "every_seconds", "interval")):
            rank_zero_warn("DistributedCheckpoint has no save trigger (every_n_train_steps, train_time_interval, "
                           "interval='auto'): it saves only on preemption or exception")
        self._source = install_source(trainer)
        self._patch_connector(trainer)

    def _patch_connector(self, trainer: "pl.Trainer") -> None:
        """Take ``fit(ckpt_path=...)`` when it names a checkpoint of ours (Lightning would ``torch.load`` it)."""
        connector = trainer._checkpoint_connector
        original = connector.resume_start

        def resume_start(checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
            ours = bool(checkpoint_path) and trainer.strategy.broadcast(is_ours(checkpoint_path))
            if checkpoint_path and not ours and self._prefer_over_hpc(trainer, checkpoint_path):
                checkpoint_path = None  # a requeued job resumes from our newest checkpoint
            if ours:
                self._requested = str(checkpoint_path)
                connector._ckpt_path = checkpoint_path
            else:
                self._lightning_ckpt = str(checkpoint_path) if checkpoint_path else None
                original(checkpoint_path, weights_only=weights_only)
            if trainer.strategy.restore_checkpoint_after_setup and self.state is not None:
                self._restore(trainer)

        connector.resume_start = resume_start
        self._connector_patched = connector

    def _prefer_over_hpc(self, trainer: "pl.Trainer", path: Any) -> bool:
        """Whether ``path`` is the ``hpc_ckpt_*.ckpt`` Lightning chose by itself and a checkpoint of ours exists."""
        hpc = trainer._checkpoint_connector._hpc_resume_path
        if hpc is None or str(path) != str(hpc) or not self.settings.resume:
            return False
        ours = trainer.strategy.broadcast(self.manager.latest() is not None if trainer.is_global_zero else None)
        if ours:
            rank_zero_info(f"DistributedCheckpoint: resuming from the newest checkpoint under {self.manager.root}, "
                           f"not from Lightning's HPC checkpoint {path}")
        return bool(ours)

    def _patch_evaluation(self, trainer: "pl.Trainer") -> None:
        """``validate``/``test``/``predict(ckpt_path=...)`` with a checkpoint of ours: load the model weights.

        Verified like a restore (checksums, the model's fingerprint); nothing a ``fit`` needs (optimizer,
        RNG, data position) is touched, nothing under the root is moved. Other paths go to Lightning.
        """
        connector = trainer._checkpoint_connector
        original = connector.resume_start
        settings = self._runtime_settings(trainer)

        def resume_start(checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
            if not (checkpoint_path and trainer.strategy.broadcast(is_ours(checkpoint_path))):
                original(checkpoint_path, weights_only=weights_only)
                return
            rec = load_model_weights(trainer.lightning_module, str(checkpoint_path), settings)
            rank_zero_info(f"DistributedCheckpoint: {trainer.state.fn} with the model weights of step {rec.step} "
                           f"({rec.path})")

        connector.resume_start = resume_start
        self._connector_patched = connector

    # ---------------------------------------------------------------- restore
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.manager is None:
            return
        fix_bucket_layout(trainer.strategy.model)  # DDP reduces alike in every run, fresh or resumed
        loader = self._source.prepare() if self._source is not None else None
        self.state = TrainState(
            model=pl_module,
            optimizers=list(trainer.optimizers),
            schedulers=[config.scheduler for config in trainer.lr_scheduler_configs],
            dataloader=loader if isinstance(loader, ResumableTrainLoader) else None,
            extra={"lightning": LightningTrainerState(trainer, owner=self)},
        )
        if isinstance(loader, ResumableTrainLoader) and loader.mode == NONE:
            rank_zero_warn("DistributedCheckpoint: the training data loader keeps no position (an iterable without "
                           "state_dict, not a StatefulDataLoader): a resume in the middle of an epoch re-reads the "
                           "batches of the epoch already trained and drops them, which is exact only when the "
                           "stream yields the same batches in the same order on every pass; a "
                           "torchdata StatefulDataLoader resumes it in place")
        if not trainer.strategy.restore_checkpoint_after_setup:
            self._restore(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._validating_in_fit = trainer.enable_validation

    def _restore(self, trainer: "pl.Trainer") -> None:
        if self._restored:
            return
        self._restored = True
        manager, state = self.manager, self.state
        rec = None
        if self._requested is not None:
            rec = self._restore_path(self._requested)
        elif self._lightning_ckpt is not None:
            rank_zero_info(f"DistributedCheckpoint: fit(ckpt_path={self._lightning_ckpt!r}) is a Lightning "
                           f"checkpoint; Lightning restores it and {manager.root} is not searched")
        else:
            rec = manager.resume(state)
        self._start_step = self._last_step = trainer.global_step
        if rec is None:
            return
        self.resumed_from = rec.step
        loader = state.dataloader
        if isinstance(loader, ResumableTrainLoader):
            sampler = loader.sampler
            if sampler is not None and sampler.consumed:
                # Lightning keeps counting this epoch's batches from where it was.
                sampler.base_batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            elif loader.mode == NONE and trainer.fit_loop.epoch_loop.batch_progress.current.processed:
                done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
                loader.skip_next(done)  # never train a batch of this epoch twice
                rank_zero_info(f"DistributedCheckpoint: reading and dropping the {done} batches of this epoch "
                               "trained before the checkpoint (the loader keeps no position)")
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None and fetcher.iterator is not None:
            iter(fetcher)  # Lightning built its iterator early (estimated_stepping_batches): use the restored state
        rank_zero_info(f"DistributedCheckpoint: resumed from step {rec.step} ({rec.path})")

    def _restore_path(self, path: str) -> Any:
        """``fit(ckpt_path=...)``: one checkpoint directory, or a root (its newest valid checkpoint)."""
        return self._driver.restore(self.state, **checkpoint_target(path, self.settings.storage_options))

    # ------------------------------------------------------------------- save
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        manager, state = self.manager, self.state
        if manager is None or state is None:
            return
        loader = self._current_loader()
        if loader is not None:
            loader.mark_trained()
        if self._validating_in_fit:
            self._val_rng = rng.capture()  # validation must not move the training RNG (on_validation_end)
        step = trainer.global_step
        if step == self._last_step:
            return  # no optimizer step on this batch (gradient accumulation)
        self._last_step = step
        self._boundary = (step, trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        state.dataloader = loader
        self._pending = (step, _loss_of(outputs))
        if not validation_follows(trainer):
            self._step_done(trainer)

    def _step_done(self, trainer: "pl.Trainer") -> None:
        """Hand the step to the loop driver: the loss check, and the save when one is due."""
        step, loss = self._pending
        self._pending = None
        self._driver.on_step(step, self.state, loss=loss, metrics=self._monitored(trainer))

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._pending is not None:  # the validation expected after the last step did not run
            rank_zero_warn(f"DistributedCheckpoint: step {self._pending[0]} was to be handled after its validation,"
                           " which did not run; no checkpoint is taken for it")
            self._pending = None

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        # A checkpoint is taken after the validation that follows its step, so a resumed run starts where the
        # uninterrupted one was after it (Lightning does not run it again); the training RNG is left as
        # validation found it.
        if self._val_rng is not None:
            rng.apply(self._val_rng)
        if self._pending is not None:
            self._step_done(trainer)

    def _current_loader(self) -> Optional[ResumableTrainLoader]:
        current = getattr(self._source, "current", None)
        return current if isinstance(current, ResumableTrainLoader) else None

    def _monitored(self, trainer: "pl.Trainer") -> dict[str, float]:
        keep_best = self.settings.keep_best
        if not keep_best or keep_best[0] not in trainer.callback_metrics:
            return {}
        return {keep_best[0]: float(trainer.callback_metrics[keep_best[0]])}

    # ------------------------------------------------------------ end, faults
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._driver is not None:
            if self._pending is not None:
                self._step_done(trainer)
            self._driver.finish()
        self._completed = True

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._close(trainer, completed=self._completed)
        elif self._connector_patched is not None:
            self._connector_patched.__dict__.pop("resume_start", None)
            self._connector_patched = None

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        manager = self.manager
        if manager is None:
            return
        # Lightning turns SIGTERM into SIGTERMException at the end of the batch in which it arrived; when the
        # signal came after this batch's save check, that is where the preemption checkpoint is taken.
        preempted = isinstance(exception, SIGTERMException) and self.settings.handle_preemption
        try:
            try:
                manager.wait()
            except Exception as e:  # noqa: BLE001 - do not hide the exception being handled
                log.warning("lightning_ckpt: the checkpoint in flight failed: %s", e)
            if self.state is not None and not isinstance(exception, Preempted) and (
                self.save_on_exception or preempted
            ):
                self._save_on_exception(trainer, exception)
        finally:
            self._close(trainer, raise_errors=False)
            if preempted:
                exception.code = self.settings.preemption_exit_code  # as ckpt_core.Preempted exits
        signum = getattr(exception, "signum", None)
        if isinstance(exception, Preempted) and signum == slurm.requeue_signal(trainer) and trainer.is_global_zero:
            slurm.requeue()  # the preemption checkpoint is committed on every rank: come back from it

    def _save_on_exception(self, trainer: "pl.Trainer", exception: BaseException) -> None:
        step = trainer.global_step
        consistent = self._at_step_boundary(trainer)
        if not all_ranks_agree(f"lightning_exception/{step}", consistent, self.exception_timeout_s):
            rank_zero_warn(f"DistributedCheckpoint: no checkpoint on {type(exception).__name__}: "
                           + ("not every rank reached the exception handler at this step" if consistent
                              else "the state is not at a step boundary"))
            return
        self._pending = None
        if trainer.validating and self._val_rng is not None:
            rng.apply(self._val_rng)  # interrupted validation: the training RNG as validation found it
        try:
            self.state.dataloader = self._current_loader()
            if self.manager.save(step, self.state, metrics=self._monitored(trainer)):
                self.manager.wait()
                rank_zero_info(f"DistributedCheckpoint: saved step {step} on {type(exception).__name__}")
        except Exception as e:  # noqa: BLE001 - do not hide the exception being handled
            log.warning("lightning_ckpt: the checkpoint on exception failed: %s", e)

    def _at_step_boundary(self, trainer: "pl.Trainer") -> bool:
        if self._boundary is None or trainer.sanity_checking:
            return False
        step, processed = self._boundary
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return (trainer.global_step == step > self._start_step
                and progress.ready == progress.started == progress.processed == processed)

    def _close(self, trainer: "pl.Trainer", raise_errors: bool = True, completed: bool = False) -> None:
        try:
            if self.manager is not None:
                try:
                    self.manager.close(completed=completed)
                except Exception as e:  # noqa: BLE001
                    if raise_errors:
                        raise
                    log.warning("lightning_ckpt: closing the checkpoint manager failed: %s", e)
        finally:
            _forget_core_signal_handlers(trainer)
            if self._driver is not None:
                self._driver.drain()
            if self._source is not None:
                self._source.restore_original()
            if self._connector_patched is not None:
                self._connector_patched.__dict__.pop("resume_start", None)
            self._source = self._connector_patched = None
            self.manager = None

    def state_dict(self) -> dict[str, Any]:
        return {}


def _forget_core_signal_handlers(trainer: "pl.Trainer") -> None:
    """Keep Lightning from re-installing a closed manager's signal handlers.

    Lightning's signal connector remembers the handlers it found when training started (the core's,
    installed at ``setup``) and puts them back in its teardown, which on an exception runs after
    ``on_exception`` closed the manager. Point it at what the manager restored instead.
    """
    from ckpt_core.preemption import PreemptionWatcher

    saved = getattr(trainer._signal_connector, "_original_handlers", {})
    for signum, handler in list(saved.items()):
        owner = getattr(handler, "__self__", None)
        still_held = getattr(owner, "holds", lambda _sig: False)(signum)  # other managers of the process listen
        if isinstance(owner, PreemptionWatcher) and not still_held:
            saved[signum] = signal.getsignal(signum)


def _loss_of(outputs: Any) -> Any:
    if outputs is None:
        return None
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    if hasattr(outputs, "detach"):
        return outputs.detach()
    return outputs if isinstance(outputs, (int, float)) else None
