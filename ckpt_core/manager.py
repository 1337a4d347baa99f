"""``CheckpointManager``: one object for the training loop, over the stages of a checkpoint's life.

Save: ``maybe_save`` asks the schedule (``schedule``) and the preemption
watcher (``preemption``); ``save`` hands the state to the ``Saver`` (stage,
then write in DCP's background process or thread; the writer commits the
manifest last, ``dcp_io``); ``poll`` collects a finished save: commit
bookkeeping, then the ``Retainer`` deletes what the retention policy lets go,
on rank 0's worker thread, and the metric callbacks get the ``SaveStats``.

Restore: the ``Restorer`` discovers, chooses, loads, verifies and applies;
the manager records where the run resumed and arms the ``ResumeCheck``.
Every decision ranks take together goes through a ``RankGroup``
(``collectives``).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
import uuid
import weakref
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import torch.distributed as dist

from . import background
from .collectives import (RankGroup, StepFlags, TorchRankGroup, checkpoint_groups, ensure_process_group,
                          first_problem, release_groups)
from .config import CheckpointSettings, resolve_entry_point
from .dcp_io import with_retries
from .decisions import GO, SKIP, SaveContext, checkpoint_too_old, on_stale, skip_reason, wanted, while_in_flight
from .discovery import choose_for_restore, list_records, read_manifest
from . import gloo_workers, lease_holder, overwritten
from .errors import RestoreError, SaveError, StaleCheckpointError, describe, release_frames
from .lease import LeaseError, LeaseHeldError, LeaseLostError, job_run_id
from .manifest import ManifestError, new_checkpoint_id
from .preemption import Preempted, PreemptionWatcher
from .rank_loss import FailFast, is_collective_failure, rank_lost
from .local_tier import LocalTier, local_group
from .records import CheckpointInfo, CheckpointRecord
from .restorer import Restorer
from .resume_check import LOSSES_NAME, ResumeCheck, recorded_losses
from .retainer import Retainer
from .retention import build_policy, mark_permanent
from .roots import check_root
from .saver import Saver, SaveStats, alert_metrics
from .schedule import SaveSchedule
from .state import TrainState
from .storage import get_fs, join, remove_tree, step_dirname, write_bytes_durable

__all__ = ["CheckpointManager", "RestoreError", "SaveError", "SaveStats"]

log = logging.getLogger("ckpt_core")

_LIVE: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()
EXIT_FLUSH_TIMEOUT_S = 120.0


@atexit.register
def _flush_at_exit() -> None:
    """Give saves still writing a bounded time to commit at interpreter exit (never hang the exit).

    One deadline for all: open managers are closed (commit bookkeeping, retention),
    then saves of managers dropped without ``close()`` get the time left. Ctrl-C ends
    the wait (a second SIGTERM kills the process: ``preemption``). Last, gloo's worker
    threads get up to ``gloo_workers.EXIT_IDLE_TIMEOUT_S`` to release their last
    collective, which aborts the process if it happens during finalization.
    """
    deadline = time.monotonic() + EXIT_FLUSH_TIMEOUT_S
    try:
        for m in list(_LIVE):
            try:
                if m._saver.finish_within(deadline - time.monotonic()):
                    m.close()
            except Exception as e:  # noqa: BLE001 - best effort at interpreter exit
                log.warning("ckpt_core: could not flush checkpoints at exit: %s", e)
        if not background.wait_pending(max(deadline - time.monotonic(), 0.0)):
            log.warning("ckpt_core: saves still writing %.0fs after exit stay uncommitted", EXIT_FLUSH_TIMEOUT_S)
    except KeyboardInterrupt:
        log.warning("ckpt_core: interrupted at exit; saves still writing stay uncommitted")
    finally:
        lease_holder.release_all()
        gloo_workers.wait_until_idle()


class CheckpointManager:
    """Saves and restores ``TrainState`` under ``root`` (local path or fsspec URL).

    Keyword arguments are ``CheckpointSettings`` fields (``every_n_steps``,
    ``keep_last``, ``async_mode``...); pass ``settings=`` to give them at once.
    ``CKPT_<NAME>`` variables (``env``, default ``os.environ``) and
    ``--ckpt.<name>`` flags (``argv``, default ``sys.argv[1:]``) override both
    (``ckpt_core.config.resolve_entry_point``); pass ``env={}, argv=[]`` for
    settings resolved already. Every rank constructs the manager and calls
    ``save``/``maybe_save``/``restore`` at the same steps: these are collective.
    """

    def __init__(self, root: Optional[str] = None, *, settings: Optional[CheckpointSettings] = None,
                 metrics_callbacks: Sequence[Callable[[SaveStats], None]] = (),
                 env: Optional[Mapping[str, str]] = None, argv: Optional[Sequence[str]] = None,
                 **kwargs: Any) -> None:
        code = {**({"dirpath": str(root)} if root is not None else {}), **kwargs}
        self.settings, self.sources = resolve_entry_point(code, settings, env=env, argv=argv)
        s = self.settings
        self.root = s.dirpath.rstrip("/") if s.dirpath not in ("/",) else s.dirpath
        self.fs, self._root_path = check_root(self.root, s.storage_options, saving=_saves(s))
        if s.async_mode == "process":
            ensure_process_group()
        on = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        self._pg, ctl_pg = checkpoint_groups(s.async_mode, s.collective_timeout_s)
        self._group: RankGroup = TorchRankGroup(self._pg, enabled=self._pg is not None)
        self._ctl: RankGroup = TorchRankGroup(ctl_pg, enabled=self._pg is not None)
        self.schedule = SaveSchedule(
            every_n_steps=s.every_n_steps, every_seconds=s.every_seconds, interval=s.interval,
            device_mtbf_hours=s.device_mtbf_hours, n_devices=s.n_devices or self.world_size,
            min_interval_s=s.min_interval_s, max_interval_s=s.max_interval_s)
        self.policy = build_policy(keep_last=s.keep_last, keep_every_n_steps=s.keep_every_n_steps,
                                   keep_every_seconds=s.keep_every_seconds, keep_best=s.keep_best)
        self._saver = Saver(s, self._pg, self._ctl)
        # side effects as functions of plain values: no reference back to the manager, so that it is freed
        # (and its process groups with it) as soon as the training script drops it, not at interpreter exit
        self._retainer = Retainer(self.policy, partial(list_records, self.root, s.storage_options),
                                  partial(_delete, self.fs, s.storage_options), active=self.rank == 0)
        self._restorer = Restorer(self.root, s, self._group, self._pg)
        self._resume_check = ResumeCheck(s.resume_check, s.resume_check_steps,
                                         partial(_write_losses, self._retainer, self.fs, self._root_path))
        self._preempt = PreemptionWatcher() if s.handle_preemption else None
        self._flags = StepFlags(self._ctl)  # maybe_save's preemption flag and clock, exchanged without a wait
        self._exchanges = self.world_size > 1 and (self._preempt is not None or self.schedule.needs_time_sync)
        self._metrics_callbacks = list(metrics_callbacks)
        self._committed: set[int] = set()
        self._inflight_dirname = ""  # the directory of the save in flight (one at a time)
        self._last_save_time = time.monotonic()
        # the age of the newest committed checkpoint (or of the run, before the first): ``checkpoint_age_s``
        self._last_commit_time = self._last_save_time
        self._last_commit_step: Optional[int] = None
        self._first_step: Optional[int] = None  # the first step the loop asked about (when nothing is committed)
        self._failed_saves = 0  # consecutive
        self._last_error: Optional[SaveError] = None
        self._n_saves = 0
        self._closed = False
        self.resumed_from: Optional[int] = None
        self._restored_locally = False
        self.last_save_stats: Optional[SaveStats] = None
        self.save_history: list[SaveStats] = []
        self._run_id: str = self._group.broadcast(uuid.uuid4().hex if self.rank == 0 else None)
        self._lease: Optional[lease_holder.RootLease] = None
        self._lease_finalizer: Optional[weakref.finalize] = None
        self._local: Optional[LocalTier] = self._make_local_tier()
        if self._local is not None:
            self._saver.reserved_host_bytes = self._local.host_bytes  # its slots count in max_host_memory_bytes
            if self._local.schedule.needs_time_sync:
                self._exchanges = self.world_size > 1  # the local tier's time trigger: rank 0's clock decides
        if _saves(s):  # a run that saves by itself takes the root's lease at start: a second job is refused now
            self._guard_lease()
        _LIVE.add(self)

    def _make_local_tier(self) -> Optional[LocalTier]:
        """The local tier when ``local_every_n_steps`` is set (collective: its gloo group is created here)."""
        s = self.settings
        if s.local_every_n_steps is None and s.local_every_seconds is None and s.local_interval is None:
            return None
        run_id, source = job_run_id(s.run_id, os.environ)
        if source in ("this process", "the torchrun agent"):
            log.warning("ckpt_core: local tier: the job id comes from %s, so a relaunched job will not find its "
                        "snapshots; set run_id (or torchrun --rdzv-id, SLURM_JOB_ID)", source)
        pg = local_group(self.world_size, s.collective_timeout_s)
        return LocalTier(s, self.rank, self.world_size, run_id, self._ctl, pg)

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, state: TrainState, metrics: Optional[dict[str, float]] = None) -> bool:
        """Save if the schedule says so (a decision every rank agrees on). Returns whether a save started.

        After a preemption signal on any rank, every rank saves this step, waits
        until it is durable and raises ``Preempted`` (a ``SystemExit`` with
        ``preemption_exit_code``).
        """
        with FailFast("save", step, self.settings.collective_timeout_s):
            return self._maybe_save(step, state, metrics)

    def _maybe_save(self, step: int, state: TrainState, metrics: Optional[dict[str, float]]) -> bool:
        self._poll(block=False)
        if self._exchanges:  # raised at the last exchange, by any rank; rank 0's clocks
            agreed = self._flags.begin()
            signum, time_due, local_due = (agreed[0] or None, bool(agreed[1]), bool(agreed[2])) \
                if agreed is not None else (None, False, False)
        else:
            signum, time_due, local_due = self._local_signal(), self._time_due(), self._local_time_due()
        due = self.schedule.step_due(step) or time_due
        if signum is not None:
            log.warning("ckpt_core: preemption signal %d received; saving step %d and exiting", signum, step)
        saved = self._save(SaveContext(step, due=due, preempted=signum is not None), state, metrics)
        if signum is not None:
            self.wait()
            raise Preempted(step, signum, self.settings.preemption_exit_code)
        if self._local is not None:
            self._local.poll()
            if self._local.due(step, local_due):
                overwritten.refuse(state.live_objects(), step)
                self._local.snapshot(step, state)
        if self._exchanges:  # this call's flags, read at the next exchange: a signal and rank 0's clocks
            self._flags.end(lambda: [self._local_signal() or 0, int(self.rank == 0 and self._time_due()),
                                     int(self.rank == 0 and self._local_time_due())])
        return saved

    def _local_signal(self) -> Optional[int]:
        return self._preempt.signum if self._preempt is not None else None

    def _local_time_due(self) -> bool:
        return self._local is not None and self._local.time_due()

    def _time_due(self) -> bool:
        return self.schedule.needs_time_sync and self.schedule.time_due(time.monotonic() - self._last_save_time)

    def poll(self) -> None:
        """Collect a background save that has finished, without blocking; not a collective.

        Its commit is recorded and retention starts on its background thread.
        ``maybe_save`` does this every step; a loop that calls ``save`` itself
        should call ``poll`` every step too, or the previous checkpoint is only
        deleted (and a failed write only reported) at the next ``save``/``wait``.
        """
        self._check_open()
        self._poll(block=False)

    def save(self, step: int, state: TrainState, metrics: Optional[dict[str, float]] = None, *,
             name: Optional[str] = None) -> bool:
        """Save ``state`` as checkpoint ``step`` (collective). Returns False when skipped.

        ``name``: the checkpoint's directory under the root (default ``step_<N>``),
        a single path component; a named save is made even when ``step`` is
        already committed under another name.
        """
        self._check_open()
        if name is not None and (not name or name in (".", "..") or any(c in name for c in "/\\\0")):
            raise ValueError(f"checkpoint directory name {name!r} must be a single path component")
        with FailFast("save", step, self.settings.collective_timeout_s):
            self._poll(block=False)
            return self._save(SaveContext(step, requested=True), state, metrics, name)

    def _save(self, ctx: SaveContext, state: TrainState, metrics: Optional[dict[str, float]],
              name: Optional[str] = None) -> bool:
        """Decide (``decisions``) and start the save of ``ctx.step``, then judge the checkpoint's age; collective
        when the save is wanted."""
        if self._first_step is None:
            self._first_step = ctx.step
        if not wanted(ctx):
            return False
        saved = self._decide_and_start(ctx, state, metrics, name)
        if not ctx.preempted:
            self._check_age(ctx.step)
        return saved

    def _decide_and_start(self, ctx: SaveContext, state: TrainState, metrics: Optional[dict[str, float]],
                          name: Optional[str]) -> bool:
        step = state.step = ctx.step
        # Every rank takes part in the agreement, also a rank whose own previous save already finished:
        # a rank-local "in flight?" test in front of it would leave the other ranks in a lone collective.
        ctx = replace(ctx, previous_done=self._saver.done_everywhere(), on_in_flight=self.settings.on_in_flight)
        action, reason = while_in_flight(ctx)
        prev = self._saver.inflight.step if self._saver.inflight is not None else "previous"
        if action == SKIP:
            log.warning("ckpt_core: skipping the save at step %d: the save at step %s is still writing (%s)",
                        step, prev, reason)
            return False
        waited_s = 0.0
        if action != GO:
            log.info("ckpt_core: save at step %d waits for the save at step %s to finish writing (%s)",
                     step, prev, reason)
            t0 = time.monotonic()
            self._poll(block=True)
            waited_s = time.monotonic() - t0  # the loop stalls for it: part of this save's cost
        why_not = skip_reason(replace(ctx, committed=name is None and step in self._committed))
        if why_not is not None:
            log.info("ckpt_core: not saving step %d: %s", step, why_not)
            return False
        return self._start(step, state, metrics, name or step_dirname(step), waited_s)

    def _start(self, step: int, state: TrainState, metrics: Optional[dict[str, float]], dirname: str,
               waited_s: float = 0.0) -> bool:
        overwritten.refuse(state.live_objects(), step)  # on every rank: a failed restore marked them on all
        try:
            self._guard_lease(step)
        except SaveError as e:
            self._save_failed(e)
            return False
        fields = {
            "checkpoint_id": new_checkpoint_id(self._run_id, step), "step": step, "epoch": state.epoch,
            "permanent": mark_permanent(step, self.settings.keep_every_n_steps),
            "metrics": dict(metrics or {}), "contents": state.contents(),
        }
        stats = SaveStats(step=step, blocking_s=0.0, first=self._n_saves == 0, interval_s=self.schedule.interval_s,
                          wait_s=waited_s)
        self._n_saves += 1
        try:
            inflight = self._saver.start(step, state, join(self.root, dirname), fields, stats)
            self._inflight_dirname = dirname
        except SaveError as e:
            self._save_failed(e)
            return False
        self._last_save_time = time.monotonic()
        # The schedule's cost C is the whole stall: the wait for the previous save and the dispatch. Only rank 0's
        # schedule decides time triggers (its flag goes through StepFlags), so rank-local measurements suffice.
        self.schedule.record_cost(stats.wait_s + stats.blocking_s)
        if self.rank == 0:
            _log_auto_interval(self.schedule, self.settings.interval)
            self._resume_check.saved(step)
        if inflight.synchronous:
            self._poll(block=True)
        return True

    def _poll(self, block: bool) -> None:
        """Collect the in-flight save if it finished (or wait for it): commit bookkeeping, retention, metrics."""
        try:
            inflight = self._saver.collect(block)
        except SaveError as e:
            self._save_failed(e)
            return
        if inflight is None:
            return
        stats = inflight.stats
        stats.committed = True
        self._committed.add(inflight.step)
        if self.rank == 0:
            failure = _read_commit(self.fs, join(self._root_path, self._inflight_dirname), stats)
            if failure is not None:
                self._save_failed(failure)
                return
            self._commit_recorded(stats)
            self._retain_in_background(stats)
        else:
            self._commit_recorded(stats)
            self._report(stats)
        if stats.write_s is not None:  # the commit lag W: the floor of the auto interval
            self.schedule.record_write(stats.write_s)
        log.info("ckpt_core: committed step %d (stall %.3fs, write %.3fs, %d bytes)",
                 stats.step, stats.blocking_s, stats.write_s, stats.bytes)

    def _retain_in_background(self, stats: SaveStats) -> None:
        """Retention on the retainer's thread; here when thread pools take no new work (interpreter exit)."""
        try:
            self._retainer.submit(self._retain, stats)
        except RuntimeError:  # "cannot schedule new futures after [interpreter] shutdown"
            self._retain(stats)

    def _commit_recorded(self, stats: SaveStats) -> None:
        """The alert metrics of a committed save; the run is protected again from here."""
        stats.age_s, stats.fallbacks = self.checkpoint_age_s, self._restorer.fallbacks
        self._failed_saves = 0
        self._last_commit_step = max(stats.step, self._last_commit_step or stats.step)
        self._last_commit_time = time.monotonic()

    def _save_failed(self, err: SaveError) -> None:
        if is_collective_failure(err):  # a rank is gone: neither a retry nor on_save_error="warn" can help
            raise rank_lost("save", err.step, err, self.settings.collective_timeout_s) from err
        self._failed_saves += 1
        self._last_error = err
        self._report(SaveStats(step=err.step, blocking_s=0.0, failed=True, age_s=self.checkpoint_age_s,
                               failed_saves=self._failed_saves, fallbacks=self._restorer.fallbacks))
        if self.settings.on_save_error == "raise":
            raise err
        release_frames(err)  # kept as _last_error: its frames must not keep the failed write's buffers and groups
        log.warning("ckpt_core: %s; training continues (on_save_error='warn', %d failed in a row, the newest "
                    "committed checkpoint is %.0fs old)", err, self._failed_saves, self.checkpoint_age_s)

    @property
    def checkpoint_age_s(self) -> float:
        """Seconds since the newest checkpoint was committed (or restored, or, before either, the manager created)."""
        return time.monotonic() - self._last_commit_time

    def alert_metrics(self) -> dict[str, float]:
        """``ckpt/age_s``, ``ckpt/failed_saves`` and ``ckpt/fallbacks`` as of now (for a logger at any step)."""
        return alert_metrics(self.checkpoint_age_s, self._failed_saves, self._restorer.fallbacks)

    @property
    def failed_saves(self) -> int:
        """Saves that failed in a row since the last commit (``on_save_error="warn"``)."""
        return self._failed_saves

    def _check_age(self, step: int) -> None:
        """After a wanted save: escalate when saves keep failing past ``max_checkpoint_age_*`` (collective).

        Every rank judges its own facts, then takes the lowest rank's verdict, so that all
        raise (or warn) at the same step.
        """
        s = self.settings
        if s.on_save_error != "warn" or (s.max_checkpoint_age_s is None and s.max_checkpoint_age_steps is None):
            return
        since = self._last_commit_step if self._last_commit_step is not None else self._first_step
        too_old = checkpoint_too_old(step - (since if since is not None else step), self.checkpoint_age_s,
                                     s.max_checkpoint_age_steps, s.max_checkpoint_age_s)
        action = on_stale(too_old, self._failed_saves, s.on_save_error, s.on_stale_checkpoint)
        agreed = first_problem(self._ctl, None if action is None or too_old is None else (action, too_old))
        if agreed is None:
            return
        action, reason = agreed
        if action == "raise":
            raise StaleCheckpointError(step, reason, self._last_commit_step,
                                       self._last_error or RuntimeError("a save failed on another rank"))
        log.warning("ckpt_core: checkpoint saves keep failing (now at step %d) and the newest committed checkpoint is "
                    "%s; training goes on unprotected (on_stale_checkpoint='warn')", step, reason)

    # ------------------------------------------------------------------ lease
    def _guard_lease(self, step: Optional[int] = None) -> None:
        """Hold the root's lease (taken at the first call) and check it is still ours; collective.

        Rank 0 takes and refreshes the lease (``lease_holder``); every rank raises
        rank 0's ``LeaseHeldError``/``LeaseLostError``, so that the whole job stops.
        A storage that cannot be written fails the save of ``step`` (``SaveError``).
        """
        if not self.settings.lease:
            return
        problem = self._lease_problem() if self.rank == 0 else None
        agreed = first_problem(self._ctl, problem)
        if agreed is None:
            return
        kind, msg = agreed
        if kind != "storage":
            raise {"held": LeaseHeldError, "lost": LeaseLostError}[kind](msg)
        if step is not None:  # the storage failed: the save fails, as on_save_error says
            raise SaveError(step, LeaseError(msg))
        if self.settings.on_save_error == "raise":
            raise LeaseError(msg + "; the root must be writable (on_save_error='warn' goes on and retries at the "
                                   "first save)")
        log.warning("ckpt_core: %s; retried at the first save (on_save_error='warn')", msg)

    def _lease_problem(self) -> Optional[tuple[str, str]]:
        try:
            if self._lease is None:
                run_id, source = job_run_id(self.settings.run_id, os.environ)
                s = self.settings
                self._lease = with_retries(
                    partial(lease_holder.hold, *get_fs(self.root, **s.storage_options), self.root, run_id, source,
                            s.lease_ttl_s),  # a file system opened now (as each save's writer's is), for every try
                    f"taking the lease on {self.root}", s.write_retries, s.retry_backoff_s)
                self._lease_finalizer = weakref.finalize(self, lease_holder.release_later, self._lease)
                self._lease_finalizer.atexit = False  # at exit, released after the last saves (_flush_at_exit)
            self._lease.check()
        except LeaseHeldError as e:
            return "held", str(e)
        except LeaseLostError as e:
            return "lost", str(e)
        except Exception as e:  # noqa: BLE001 - the storage failed: as a failed save would
            return "storage", f"could not take the lease on checkpoint root {self.root}: {describe(e)}"
        return None

    def _retain(self, stats: SaveStats) -> None:
        """On the retainer's thread: delete what the policy lets go (never this save, the resumed or in flight)."""
        if self._lease is not None and self._lease.lost is not None:
            log.warning("ckpt_core: retention skipped: %s", self._lease.lost)
            self._report(stats)
            return

        def protected() -> set[int]:
            inflight = self._saver.inflight
            return ({self.resumed_from} if self.resumed_from is not None else set()) | (
                {inflight.step} if inflight is not None else set())

        stats.deleted.extend(self._retainer.retain({stats.step}, protected))
        self._report(stats)

    def _report(self, stats: SaveStats) -> None:
        self.last_save_stats = stats
        self.save_history.append(stats)
        for cb in self._metrics_callbacks:
            try:
                cb(stats)
            except Exception as e:  # noqa: BLE001
                log.warning("ckpt_core: metrics callback failed: %s", e)

    def add_metrics_callback(self, cb: Callable[[SaveStats], None]) -> None:
        self._metrics_callbacks.append(cb)

    # ------------------------------------------------------------ resume check
    def wants_loss(self, step: int) -> bool:
        """Whether ``record_loss(step, ...)`` would use the loss (lets callers skip a device sync otherwise)."""
        return self.rank == 0 and self._resume_check.wants(step)

    def record_loss(self, step: int, loss: float) -> None:
        """Record the training loss of ``step`` (rank 0's value counts): the resume check (``resume_check``)."""
        if self.rank == 0:
            self._resume_check.record(step, loss)

    @property
    def resume_check_failures(self) -> list[str]:
        """The resume check's mismatches so far (with ``resume_check="warn"``)."""
        return self._resume_check.failures

    # -------------------------------------------------------------- lifecycle
    def wait(self) -> None:
        """Block until the in-flight save is committed and retention has run (and the local tier's snapshot in
        flight is committed and replicated)."""
        inflight = self._saver.inflight
        with FailFast("save", inflight.step if inflight is not None else None, self.settings.collective_timeout_s):
            self._poll(block=True)
            if self._local is not None:
                self._local.wait()
        self._retainer.wait()

    def close(self, completed: bool = False) -> None:
        """Flush and release staging buffers, threads and signal handlers. Safe to call twice.

        ``completed``: training ended without error, so the local tier's snapshots of this job are
        removed (``local_cleanup``), also when the manager was closed before without it.
        """
        if self._closed:
            if completed and self._local is not None:
                self._local.remove_snapshots()
            return
        idle = False
        try:
            with FailFast("save", None, self.settings.collective_timeout_s):
                self._flags.drain()  # every rank issued it at its last maybe_save
            self.wait()
            if self._local is not None:
                with FailFast("save", None, self.settings.collective_timeout_s):
                    self._local.close(completed)
            idle = True
        finally:
            self._closed = True
            if self._preempt is not None:
                self._preempt.uninstall()
            self._saver.close()
            self._retainer.shutdown()
            if self._lease_finalizer is not None:
                self._lease_finalizer()  # releases this manager's use of the lease, once
            _LIVE.discard(self)
            self._release_groups(destroy=idle)

    def _release_groups(self, destroy: bool) -> None:
        """Drop this manager's process groups; ``destroy``: no collective of theirs can be running, so destroy them.

        Destroyed, a gloo group's worker threads are joined now, while the interpreter is alive: a
        worker that frees the tensors of the last collective needs the GIL, and one doing so during
        interpreter finalization aborts the process ("terminate called without an active exception").
        A handled failure (a failed save under ``on_save_error="warn"``, a fallback) leaves reference cycles
        through DCP's frames that hold the groups: a garbage collection first frees them, so that destroying
        a group drops its last reference (one collection, at close only, and only for a distributed run).
        After a failure a collective may still wait for a lost rank; the groups are only dropped then.
        """
        if destroy:
            if self._pg is not None:
                gc.collect()
            release_groups(self._pg, getattr(self._ctl, "group", None),
                           self._local.process_group if self._local is not None else None)
        self._pg = None
        self._exchanges = False
        self._group = self._ctl = TorchRankGroup(None, enabled=False)
        self._flags = StepFlags(self._ctl)
        self._saver = Saver(self.settings.replace(async_mode="off"), None, self._ctl)
        self._restorer = Restorer(self.root, self.settings, self._group, None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed; create a new one")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(completed=exc_type is None)

    # ---------------------------------------------------------------- restore
    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory under the root, oldest first (committed or not)."""
        return list_records(self.root, self.settings.storage_options)

    def latest(self) -> Optional[CheckpointInfo]:
        cands = choose_for_restore(self.list())
        return cands[0] if cands else None

    @property
    def last_restore_timings(self) -> dict[str, float]:
        """Seconds the last restore spent to discover, load, apply and verify (from the tier it restored from)."""
        return dict(self._local.timings) if self._restored_locally and self._local is not None \
            else self._restorer.timings

    def resume(self, state: TrainState) -> Optional[CheckpointInfo]:
        """Restore as the settings say: nothing when ``resume=False``, ``resume_step`` when set, else the newest valid."""
        if not self.settings.resume:
            return None
        return self.restore(state, step=self.settings.resume_step)

    def restore(self, state: TrainState, step: Optional[int] = None, *, path: Optional[str] = None,
                set_aside_newer: bool = True, weights_only: bool = False) -> Optional[CheckpointInfo]:
        """Restore the newest valid checkpoint (or exactly ``step``, or the directory ``path``) into ``state``.

        Returns the restored checkpoint, or None when the root holds none (start
        fresh). Corrupt, tampered or incomplete checkpoints are skipped with a
        warning naming them and the reason; nothing is applied until a whole
        checkpoint loaded, every item read matched its checksum and the
        fingerprint matched. Restoring an explicit ``step`` (or a ``path`` under
        this root) is a rollback: newer checkpoints are moved to
        ``rolled_back/`` unless ``set_aside_newer=False``. ``path`` may be any
        checkpoint directory, whatever its name, also under another root.
        ``weights_only=True`` (with a ``TrainState`` holding the model alone) loads
        the weights for evaluation: only the model's fingerprint must match.
        """
        self._check_open()
        with FailFast("restore", lambda: self._restorer.loading, self.settings.collective_timeout_s):
            return self._restore(state, step, path, set_aside_newer, weights_only)

    def _restore(self, state: TrainState, step: Optional[int], path: Optional[str], set_aside_newer: bool,
                 weights_only: bool) -> Optional[CheckpointInfo]:
        automatic = step is None and path is None and not weights_only
        listed = None  # rank 0's listing of the root, when the local tier needed it first: listed once
        if automatic and self._local is not None:
            listed = list_records(self.root, self.settings.storage_options) if self.rank == 0 else None
            rec = self._restore_local(state, listed)
            self._restored_locally = rec is not None
            if rec is not None:
                return rec
        rec, committed = self._restorer.restore(state, step, path, weights_only, listed)
        self._committed |= committed
        if self._local is not None and not weights_only:  # the run goes on from here: later snapshots go
            self._local.after_restore(rec.step if rec is not None else None)
        if rec is None:
            return None
        self._resumed_at(rec.step)
        self._committed.add(rec.step)  # on storage: the durable tier never saves this step again
        if self.rank == 0:  # at the same world size the run continues exactly: the same first losses
            same = rec.world_size == self.world_size
            self._resume_check.resumed(recorded_losses(rec.path, self.settings.storage_options) if same else {})
        if set_aside_newer and (step is not None or path is not None) and self._restorer.owns(rec):
            self._guard_lease()  # a rollback moves checkpoints: it writes the root
            self._restorer.set_aside_newer(rec.step)
            self._committed = {c for c in self._committed if c <= rec.step}
        return rec


    def _resumed_at(self, step: int) -> None:
        """The run goes on from checkpoint ``step`` (either tier): the newest checkpoint, its age counted from now."""
        self.resumed_from = step
        self._last_save_time = self._last_commit_time = time.monotonic()
        self._last_commit_step = step

    def _restore_local(self, state: TrainState, listed: Optional[list[CheckpointInfo]]) -> Optional[CheckpointInfo]:
        """The local tier's newest complete snapshot, when newer than the durable tier's newest in rank 0's
        ``listed`` (collective)."""
        assert self._local is not None
        newest = choose_for_restore(listed) if listed is not None else []
        durable = self._group.broadcast(newest[0].step if newest else None)
        snapshot = self._local.recover(state, durable)
        if snapshot is None:
            return None
        overwritten.clear(state.live_objects())  # a whole snapshot was applied and checked
        self._local.after_restore(snapshot.step)
        rec = CheckpointRecord(step=snapshot.step, path=self._local.job_dir, committed=True,
                               world_size=snapshot.world_size, epoch=snapshot.epoch, wall_time=snapshot.wall_time)
        self._resumed_at(rec.step)
        if self.rank == 0:
            self._resume_check.resumed({})
            log.info("ckpt_core: resumed from the local tier at step %d (durable tier's newest: step %s)",
                     rec.step, durable)
        return rec


def _saves(s: CheckpointSettings) -> bool:
    """Whether a manager with these settings saves by itself (so its root must be writable from the start)."""
    return any(v is not None for v in (s.every_n_steps, s.every_seconds, s.interval))


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _log_auto_interval(schedule: SaveSchedule, interval: Optional[str]) -> None:
    if interval != "auto":
        return
    d = schedule.describe()
    log.info("ckpt_core: auto interval %s s (save cost C=%s s, write time W=%s s, cluster MTBF M=%s s, expected "
             "time lost %s)", _fmt(d.get("interval_s")), _fmt(d.get("cost_s")), _fmt(d.get("write_s")),
             _fmt(d.get("mtbf_s")), _fmt(d.get("expected_overhead")))
    if schedule.write_bound:
        log.warning("ckpt_core: saves take %s s to write, more than max_interval_s=%s; the auto interval is the "
                    "write time (a shorter one would only make saves wait for each other)",
                    _fmt(d.get("write_s")), _fmt(schedule.max_interval_s))


def _read_commit(fs: Any, path: str, stats: SaveStats) -> Optional[SaveError]:
    """Rank 0: the committed manifest's size and health into ``stats``; the error when it is missing."""
    try:
        manifest = read_manifest(fs, path)
    except (FileNotFoundError, ManifestError) as e:
        return SaveError(stats.step, RuntimeError(f"the manifest was not committed: {e}"))
    stats.bytes, stats.healthy = manifest.total_bytes, manifest.healthy
    if not manifest.healthy:
        log.warning("ckpt_core: checkpoint at step %d holds non-finite values; it is kept but marked unhealthy "
                    "and will not be chosen for automatic resume", stats.step)
    return None


def _delete(fs: Any, storage_options: Mapping[str, Any], rec: CheckpointInfo) -> None:
    remove_tree(fs, get_fs(rec.path, **storage_options)[1])


def _write_losses(retainer: Retainer, fs: Any, root_path: str, step: int, body: bytes) -> None:
    """The resume check's record of the losses after ``step``, written on the retainer's thread."""
    retainer.submit(_write_quiet, fs, join(root_path, step_dirname(step), LOSSES_NAME), body)


def _write_quiet(fs: Any, path: str, body: bytes) -> None:
    try:
        write_bytes_durable(fs, path, body)
    except Exception as e:  # noqa: BLE001 - a missing loss record only disables the resume check
        log.warning("ckpt_core: could not record losses at %s: %s", path, e)
