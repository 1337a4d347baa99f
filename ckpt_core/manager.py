"""``CheckpointManager``: save when due, asynchronously; commit last; retain; restore the newest valid.

Save: trigger (``schedule``) -> capture (``TrainState``) -> stage (DCP's
``DefaultStager``, buffers reused) -> write (DCP + ``dcp_io.CommitWriter``, in
DCP's background process or thread) -> commit (the writer's ``finish``) ->
retain (``retention``, in a background thread on rank 0).

Restore: discover -> choose (newest valid, fallback) -> load into fresh
buffers (DCP, resharding) -> verify the fingerprint -> apply -> verify again.
"""

from __future__ import annotations

import atexit
import logging
import time
import uuid
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from . import fingerprint as fp
from .collectives import RankGroup, TorchRankGroup, all_done, any_signal, first_problem, rank0_decides
from .config import CheckpointSettings, resolve_entry_point
from .dcp_io import SafeLoadPlanner, make_reader, make_writer
from .discovery import choose_for_restore, list_records, read_manifest, record_at, validate
from .errors import RestoreError, SaveError, describe, is_fatal
from .manifest import Manifest, ManifestError, new_checkpoint_id
from .preemption import Preempted, PreemptionWatcher
from .records import CheckpointInfo
from .retention import build_policy, mark_permanent, records_to_delete
from .roots import check_root
from .resume_check import LOSSES_NAME, ResumeCheck, parse_losses
from .schedule import SaveSchedule
from .state import StateMismatchError, TrainState
from .storage import get_fs, join, remove_tree, step_dirname, write_bytes_durable

log = logging.getLogger("ckpt_core")


# DCP also warns from the thread that runs an async save, where the ``catch_warnings`` around
# ``dcp.async_save`` below does not reach: a single-process save is intended, and a step directory
# being saved again is an uncommitted (torn) one.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        module="torch.distributed.checkpoint")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint", module="torch.distributed.checkpoint")


@dataclass
class SaveStats:
    """Timing and size of one save, as reported to metric callbacks."""

    step: int
    blocking_s: float
    write_s: Optional[float] = None
    bytes: int = 0
    committed: bool = False
    healthy: bool = True
    interval_s: Optional[float] = None
    deleted: list = field(default_factory=list)
    first: bool = False

    @property
    def throughput_bytes_per_s(self) -> Optional[float]:
        return self.bytes / self.write_s if self.write_s else None

    def as_metrics(self) -> dict[str, float]:
        out = {"ckpt/step": float(self.step), "ckpt/blocking_s": self.blocking_s, "ckpt/bytes": float(self.bytes)}
        if self.write_s is not None:
            out["ckpt/write_s"] = self.write_s
        if self.throughput_bytes_per_s is not None:
            out["ckpt/throughput_MBps"] = self.throughput_bytes_per_s / 1e6
        if self.interval_s is not None:
            out["ckpt/interval_s"] = self.interval_s
        out["ckpt/deleted"] = float(len(self.deleted))
        return out


@dataclass
class _InFlight:
    step: int
    future: Future
    stats: SaveStats
    t_dispatch: float
    t_done: Optional[float] = None


def _saves(s: CheckpointSettings) -> bool:
    """Whether a manager with these settings saves by itself (so its root must be writable from the start)."""
    return any(v is not None for v in (s.every_n_steps, s.every_seconds, s.interval))


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _ensure_process_group() -> None:
    """DCP's background process needs a process group; give a lone process a 1-rank gloo one."""
    if _dist_on():
        return
    from torch.distributed.elastic.utils.distributed import get_free_port

    store = dist.TCPStore("127.0.0.1", get_free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    log.info("ckpt_core: started a 1-rank gloo process group for the background checkpoint process")


_LIVE: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


EXIT_FLUSH_TIMEOUT_S = 120.0


@atexit.register
def _flush_at_exit() -> None:
    """Give an in-flight save a bounded time to commit at interpreter exit (never hang the exit)."""
    for m in list(_LIVE):
        try:
            m._flush_for_exit(EXIT_FLUSH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - best effort at interpreter exit
            log.warning("ckpt_core: could not flush checkpoints at exit: %s", e)


class CheckpointManager:
    """Saves and restores ``TrainState`` under ``root`` (local path or fsspec URL).

    Keyword arguments are ``CheckpointSettings`` fields (``every_n_steps``,
    ``keep_last``, ``async_mode``...); pass ``settings=`` to give them at once.
    ``CKPT_<NAME>`` variables (``env``, default ``os.environ``) and
    ``--ckpt.<name>`` flags (``argv``, default ``sys.argv[1:]``) override both
    (``ckpt_core.config.resolve_entry_point``); pass ``env={}, argv=[]`` for
    settings resolved already.
    Every rank constructs the manager and calls ``save``/``maybe_save``/
    ``restore`` at the same steps: these are collective.
    """

    def __init__(
        self,
        root: Optional[str] = None,
        *,
        settings: Optional[CheckpointSettings] = None,
        metrics_callbacks: Sequence[Callable[[SaveStats], None]] = (),
        env: Optional[Mapping[str, str]] = None,
        argv: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> None:
        code = {**({"dirpath": str(root)} if root is not None else {}), **kwargs}
        self.settings, self.sources = resolve_entry_point(code, settings, env=env, argv=argv)
        s = self.settings
        self.root = s.dirpath.rstrip("/") if s.dirpath not in ("/",) else s.dirpath
        self.fs, self._root_path = check_root(self.root, s.storage_options, saving=_saves(s))
        self._metrics_callbacks = list(metrics_callbacks)
        self.rank = dist.get_rank() if _dist_on() else 0
        self.world_size = dist.get_world_size() if _dist_on() else 1
        self.schedule = SaveSchedule(
            every_n_steps=s.every_n_steps,
            every_seconds=s.every_seconds,
            interval=s.interval,
            device_mtbf_hours=s.device_mtbf_hours,
            n_devices=s.n_devices or self.world_size,
            min_interval_s=s.min_interval_s,
            max_interval_s=s.max_interval_s,
        )
        self.policy = build_policy(
            keep_last=s.keep_last,
            keep_every_n_steps=s.keep_every_n_steps,
            keep_every_seconds=s.keep_every_seconds,
            keep_best=s.keep_best,
        )
        if s.async_mode == "process":
            _ensure_process_group()
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._pg = dist.new_group(backend="gloo") if _dist_on() and dist.get_world_size() > 1 else None
        # In thread mode DCP's writer runs collectives on self._pg in a background thread; the
        # training thread's own agreements (preemption, "save done?", time sync) use another group,
        # because two threads issuing collectives on one gloo group mismatch them and hang.
        self._ctl_pg = (dist.new_group(backend="gloo") if self._pg is not None and s.async_mode == "thread"
                        else self._pg)
        self._stager: Optional[DefaultStager] = None
        if s.async_mode != "off":
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=s.async_mode == "process",
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        self._inflight: Optional[_InFlight] = None
        self._retention = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-retention") if self.rank == 0 else None
        self._retention_futures: list[Future] = []
        self._committed: set[int] = set()
        self.resumed_from: Optional[int] = None
        self.last_save_stats: Optional[SaveStats] = None
        self.save_history: list[SaveStats] = []
        self._last_save_time = time.monotonic()
        self._n_saves = 0
        self._closed = False
        self._preempt = PreemptionWatcher() if s.handle_preemption else None
        self._group: RankGroup = TorchRankGroup(self._pg, enabled=self._pg is not None)
        self._ctl: RankGroup = TorchRankGroup(self._ctl_pg, enabled=self._pg is not None)
        self._run_id: str = self._group.broadcast(uuid.uuid4().hex if self.rank == 0 else None)
        self._resume_check = ResumeCheck(s.resume_check, s.resume_check_steps, self._write_losses)
        self.last_restore_timings: dict[str, float] = {}
        _LIVE.add(self)

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, state: TrainState, metrics: Optional[dict[str, float]] = None) -> bool:
        """Save if the schedule says so (a decision every rank agrees on). Returns whether a save started.

        After a preemption signal on any rank, every rank saves this step, waits
        until it is durable and raises ``Preempted`` (a ``SystemExit`` with
        ``preemption_exit_code``).
        """
        self._poll(block=False)
        if self._preempt is not None:
            signum = any_signal(self._ctl, self._preempt.signum)
            if signum is not None:
                log.warning("ckpt_core: preemption signal %d received; saving step %d and exiting", signum, step)
                self.save(step, state, metrics=metrics)
                self.wait()
                raise Preempted(step, signum, self.settings.preemption_exit_code)
        elapsed = time.monotonic() - self._last_save_time
        due = self.schedule.should_save(step, elapsed)
        if self.schedule.needs_time_sync:
            due = rank0_decides(self._ctl, due)
        if not due:
            return False
        return self.save(step, state, metrics=metrics)

    def poll(self) -> None:
        """Collect a background save that has finished, without blocking; not a collective.

        Its commit is recorded and retention starts on its background thread.
        ``maybe_save`` does this every step; a loop that calls ``save`` itself
        should call ``poll`` every step too, or the previous checkpoint is only
        deleted (and a failed write only reported) at the next ``save``/``wait``.
        """
        self._check_open()
        self._poll(block=False)

    def save(self, step: int, state: TrainState, metrics: Optional[dict[str, float]] = None) -> bool:
        """Save ``state`` as checkpoint ``step`` (collective). Returns False when skipped."""
        self._check_open()
        state.step = step
        self._poll(block=False)
        # Every rank takes part in the agreement, also a rank whose own previous save already finished:
        # a rank-local "in flight?" test in front of it would leave the other ranks in a lone collective.
        if not self._agree_done():
            prev = self._inflight.step if self._inflight is not None else "previous"
            if self.settings.on_in_flight == "skip":
                log.warning("ckpt_core: skipping the save at step %d: the save at step %s is still writing",
                            step, prev)
                return False
            log.info("ckpt_core: save at step %d waits for the save at step %s to finish writing", step, prev)
            self._poll(block=True)
        if step in self._committed:
            log.info("ckpt_core: step %d is already committed; not saving it again", step)
            return False
        path = join(self.root, step_dirname(step))
        fields = {
            "checkpoint_id": new_checkpoint_id(self._run_id, step),
            "step": step,
            "epoch": state.epoch,
            "permanent": mark_permanent(step, self.settings.keep_every_n_steps),
            "metrics": dict(metrics or {}),
            "contents": state.contents(),
        }
        writer = make_writer(path, fields, storage_options=self.settings.storage_options,
                             thread_count=self.settings.writer_threads, retries=self.settings.write_retries,
                             backoff_s=self.settings.retry_backoff_s)
        planner = DefaultSavePlanner(enable_plan_caching=True)
        mode = self._mode_for(state)
        t0 = time.monotonic()
        try:
            fut = self._dispatch(mode, state, writer, planner)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if is_fatal(e):
                raise
            self._n_saves += 1
            self._save_failed(SaveError(step, e))
            return False
        t1 = time.monotonic()
        stats = SaveStats(step=step, blocking_s=t1 - t0, first=self._n_saves == 0,
                          interval_s=self.schedule.interval_s)
        self._n_saves += 1
        self._last_save_time = t1
        self.schedule.record_cost(stats.blocking_s)
        if self.settings.interval == "auto" and self.rank == 0:
            d = self.schedule.describe()
            log.info("ckpt_core: auto interval %s s (save cost C=%s s, cluster MTBF M=%s s, expected time lost %s)",
                     _fmt(d.get("interval_s")), _fmt(d.get("cost_s")), _fmt(d.get("mtbf_s")),
                     _fmt(d.get("expected_overhead")))
        if self.rank == 0:
            self._resume_check.saved(step)
        inflight = _InFlight(step=step, future=fut, stats=stats, t_dispatch=t0)
        fut.add_done_callback(lambda _f, i=inflight: setattr(i, "t_done", time.monotonic()))
        self._inflight = inflight
        if mode == "off":
            self._poll(block=True)
        return True

    def _dispatch(self, mode: str, state: TrainState, writer: Any, planner: Any) -> Future:
        """Run the save synchronously (``off``) or hand it to DCP's async machinery; a future either way."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if mode == "off":
                dcp.save(state.state_dict(), storage_writer=writer, planner=planner, process_group=self._pg)
                fut: Future = Future()
                fut.set_result(None)
                return fut
            return dcp.async_save(
                state.state_dict(),
                storage_writer=writer,
                planner=planner,
                process_group=self._pg,
                async_checkpointer_type=(
                    AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
                ),
                async_stager=self._stager,
            )

    def _mode_for(self, state: TrainState) -> str:
        mode = self.settings.async_mode
        limit = self.settings.max_host_memory_bytes
        if mode != "off" and limit is not None:
            nbytes = _state_bytes(state)
            if nbytes > limit:
                log.warning(
                    "ckpt_core: state of %d bytes exceeds max_host_memory_bytes=%d; saving synchronously "
                    "(no staging copy) instead of asynchronously", nbytes, limit)
                return "off"
        return mode

    def _agree_done(self) -> bool:
        """Whether the in-flight save is done on every rank (so all ranks take the same branch)."""
        return all_done(self._ctl, self._inflight is None or self._inflight.future.done())

    def _poll(self, block: bool) -> None:
        """Collect the in-flight save if it finished (or wait for it): commit bookkeeping, retention, metrics."""
        inflight = self._inflight
        if inflight is None or (not block and not inflight.future.done()):
            return
        self._inflight = None
        try:
            inflight.future.result()
        except BaseException as e:  # noqa: BLE001 - reported on the training side
            self._save_failed(SaveError(inflight.step, e))
            return
        stats = inflight.stats
        stats.write_s = (inflight.t_done or time.monotonic()) - inflight.t_dispatch
        stats.committed = True
        self._committed.add(inflight.step)
        if self.rank == 0:
            try:
                manifest = read_manifest(self.fs, join(self._root_path, step_dirname(inflight.step)))
                stats.bytes, stats.healthy = manifest.total_bytes, manifest.healthy
                if not manifest.healthy:
                    log.warning("ckpt_core: checkpoint at step %d holds non-finite values; it is kept but "
                                "marked unhealthy and will not be chosen for automatic resume", inflight.step)
            except (FileNotFoundError, ManifestError) as e:
                self._save_failed(SaveError(inflight.step, RuntimeError(f"the manifest was not committed: {e}")))
                return
            self._retention_futures = [f for f in self._retention_futures if not f.done()]
            self._retention_futures.append(self._retention.submit(self._apply_retention, stats))
        else:
            self._report(stats)
        log.info("ckpt_core: committed step %d (stall %.3fs, write %.3fs, %d bytes)",
                 stats.step, stats.blocking_s, stats.write_s, stats.bytes)

    def _save_failed(self, err: SaveError) -> None:
        if self.settings.on_save_error == "raise":
            raise err
        log.warning("ckpt_core: %s; training continues (on_save_error='warn')", err)

    def _apply_retention(self, stats: SaveStats) -> None:
        try:
            records = list_records(self.root, self.settings.storage_options)
            protected = {stats.step}
            if self.resumed_from is not None:
                protected.add(self.resumed_from)
            if self._inflight is not None:
                protected.add(self._inflight.step)
            for rec in records_to_delete(records, self.policy, protected):
                remove_tree(self.fs, get_fs(rec.path, **self.settings.storage_options)[1])
                stats.deleted.append(rec.step)
            if stats.deleted:
                log.info("ckpt_core: retention deleted steps %s", stats.deleted)
        except BaseException as e:  # noqa: BLE001 - retention must never break training
            if is_fatal(e):
                raise
            log.warning("ckpt_core: retention failed: %s", e)
        self._report(stats)

    def _report(self, stats: SaveStats) -> None:
        self.last_save_stats = stats
        self.save_history.append(stats)
        for cb in self._metrics_callbacks:
            try:
                cb(stats)
            except Exception as e:  # noqa: BLE001
                log.warning("ckpt_core: metrics callback failed: %s", e)

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

    def _write_losses(self, step: int, body: bytes) -> None:
        path = join(self._root_path, step_dirname(step), LOSSES_NAME)
        self._retention_futures.append(self._retention.submit(self._write_quiet, path, body))

    def _write_quiet(self, path: str, body: bytes) -> None:
        try:
            write_bytes_durable(self.fs, path, body)
        except Exception as e:  # noqa: BLE001 - a missing loss record only disables the resume check
            log.warning("ckpt_core: could not record losses at %s: %s", path, e)

    def _load_expected_losses(self, rec: CheckpointInfo) -> None:
        expected: dict[int, float] = {}
        if self.rank == 0 and self.settings.resume_check != "off" and rec.world_size == self.world_size:
            try:
                fs, fs_path = get_fs(rec.path, **self.settings.storage_options)
                expected = parse_losses(fs.cat_file(join(fs_path, LOSSES_NAME)))
            except (OSError, ValueError):
                pass
        self._resume_check.resumed(expected)

    def add_metrics_callback(self, cb: Callable[[SaveStats], None]) -> None:
        self._metrics_callbacks.append(cb)

    def wait(self) -> None:
        """Block until the in-flight save is committed and retention has run."""
        self._poll(block=True)
        for f in list(self._retention_futures):
            f.result()
        self._retention_futures = []

    def _flush_for_exit(self, timeout_s: float) -> None:
        inflight = self._inflight
        if inflight is not None:
            try:
                inflight.future.result(timeout=timeout_s)
            except FutureTimeout:
                log.warning("ckpt_core: the save at step %d did not finish within %.0fs of exit; it stays "
                            "uncommitted", inflight.step, timeout_s)
                return
            except Exception:  # noqa: BLE001 - reported below by close()
                pass
        self.close()

    def close(self) -> None:
        """Flush and release staging buffers, threads and signal handlers. Safe to call twice."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._preempt is not None:
                self._preempt.uninstall()
            if self._stager is not None:
                self._stager.close()
            if self._retention is not None:
                self._retention.shutdown(wait=True)
            _LIVE.discard(self)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed; create a new one")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- listing
    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory under the root, oldest first (committed or not)."""
        return list_records(self.root, self.settings.storage_options)

    def latest(self) -> Optional[CheckpointInfo]:
        cands = choose_for_restore(self.list())
        return cands[0] if cands else None

    # --------------------------------------------------------------- restore
    def resume(self, state: TrainState) -> Optional[CheckpointInfo]:
        """Restore as the settings say: nothing when ``resume=False``, ``resume_step`` when set, else the newest valid."""
        if not self.settings.resume:
            return None
        return self.restore(state, step=self.settings.resume_step)

    def restore(self, state: TrainState, step: Optional[int] = None, *, path: Optional[str] = None,
                set_aside_newer: bool = True) -> Optional[CheckpointInfo]:
        """Restore the newest valid checkpoint (or exactly ``step``, or the directory ``path``) into ``state``.

        Returns the restored checkpoint, or None when the root holds none (start
        fresh). Corrupt, tampered or incomplete checkpoints are skipped with a
        warning naming them and the reason; nothing is applied until a whole
        checkpoint loaded, every item read matched its checksum and the
        fingerprint matched. Restoring an explicit ``step`` (or a ``path`` under
        this root) is a rollback: newer checkpoints are moved to
        ``rolled_back/`` unless ``set_aside_newer=False``. ``path`` may be any
        checkpoint directory, whatever its name, also under another root.
        """
        self._check_open()
        t0 = time.monotonic()
        self.last_restore_timings = {}
        explicit = step is not None or path is not None
        candidates = self._group.broadcast(self._candidates(step, path) if self.rank == 0 else None)
        if explicit and not candidates:
            raise RestoreError(f"no committed checkpoint at step {step} under {self.root}")
        for rec in candidates:
            problem = self._group.broadcast(self._problem(rec) if self.rank == 0 else None)
            self.last_restore_timings["discover"] = time.monotonic() - t0
            if problem is None:
                try:
                    self._load_and_apply(rec, state)
                except _Unloadable as e:
                    problem = str(e)
            if problem is None:
                self._restored(rec, set_aside_newer and explicit and self._owns(rec))
                log.info("ckpt_core: restored step %d from %s in %.2fs %s", rec.step, rec.path,
                         time.monotonic() - t0, self.last_restore_timings)
                return rec
            msg = f"checkpoint {rec.path} (step {rec.step}) is not usable: {problem}"
            if explicit:
                raise RestoreError(msg)
            if self.rank == 0:
                warnings.warn(msg + "; falling back to an older checkpoint", stacklevel=2)
            log.warning("ckpt_core: %s; falling back", msg)
        if candidates:
            raise RestoreError(f"no checkpoint under {self.root} could be restored (tried steps "
                               f"{[r.step for r in candidates]}); see the warnings above")
        return None

    def _restored(self, rec: CheckpointInfo, set_aside: bool) -> None:
        self.resumed_from = rec.step
        self._committed.add(rec.step)
        self._last_save_time = time.monotonic()
        self._load_expected_losses(rec)
        if set_aside:
            self._set_aside_newer(rec.step)

    def _owns(self, rec: CheckpointInfo) -> bool:
        """Whether ``rec`` lies directly under this manager's root (a rollback may then move newer ones aside)."""
        _, rec_path = get_fs(rec.path, **self.settings.storage_options)
        return rec_path.rstrip("/").rsplit("/", 1)[0] == self._root_path.rstrip("/")

    def _set_aside_newer(self, step: int) -> None:
        """After a rollback to ``step``, move newer checkpoints to ``rolled_back/<time>/`` (never delete them)."""
        if self.rank == 0:
            newer = [r for r in self.list() if r.step > step]
            if newer:
                dest = join(self._root_path, "rolled_back", time.strftime("%Y%m%dT%H%M%S", time.gmtime()))
                self.fs.makedirs(dest, exist_ok=True)
                for r in newer:
                    src = get_fs(r.path, **self.settings.storage_options)[1]
                    self.fs.mv(src, join(dest, src.rstrip("/").rsplit("/", 1)[-1]), recursive=True)
                    self._committed.discard(r.step)
                log.warning("ckpt_core: rolled back to step %d; moved newer checkpoints %s to %s",
                            step, [r.step for r in newer], dest)
        self._committed = {c for c in self._committed if c <= step}
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _candidates(self, step: Optional[int], path: Optional[str] = None) -> list[CheckpointInfo]:
        if path is not None:
            fs, fs_path = get_fs(path, **self.settings.storage_options)
            return [record_at(fs, path.rstrip("/"), fs_path)]
        records = self.list()
        self._committed |= {r.step for r in records if r.committed}
        chosen = choose_for_restore(records, step)
        newest = chosen[0].step if chosen else -1
        for r in records:
            if r.step > newest and step is None:
                if r.problem and "unusable" in r.problem:
                    warnings.warn(f"checkpoint {r.path} (step {r.step}) is skipped: {r.problem}", stacklevel=3)
                elif r.committed and not r.healthy:
                    log.warning("ckpt_core: skipping %s (step %d): saved with non-finite values (unhealthy); "
                                "restore(step=%d) loads it explicitly", r.path, r.step, r.step)
                elif not r.committed:
                    log.info("ckpt_core: ignoring %s (step %d): %s", r.path, r.step, r.problem)
        return chosen

    def _read_manifest(self, rec: CheckpointInfo) -> Manifest:
        fs, fs_path = get_fs(rec.path, **self.settings.storage_options)
        return read_manifest(fs, fs_path)

    def _problem(self, rec: CheckpointInfo) -> Optional[str]:
        if not rec.committed:
            return rec.problem or "not committed"
        try:
            manifest = self._read_manifest(rec)
        except (FileNotFoundError, ManifestError) as e:
            return f"manifest: {e}"
        if (manifest.step, manifest.checkpoint_id) != (rec.step, rec.checkpoint_id):
            return "its manifest changed while it was being restored"
        try:
            # every rank unpickles .metadata next (_prepare_load), under the same allowlist
            return validate(rec.path, manifest, self.settings.verify, self.settings.storage_options,
                            unpickle_metadata=False)
        except BaseException as e:  # noqa: BLE001 - any failure to check it means: fall back
            if is_fatal(e):
                raise
            return f"cannot be checked: {describe(e)}"

    def _agree(self, problem: Optional[tuple[str, str]]) -> Optional[tuple[str, str]]:
        """The first rank's ``(kind, message)`` problem, on every rank (so every rank takes the same branch)."""
        return first_problem(self._group, problem)

    def _prepare_load(self, rec: CheckpointInfo, state: TrainState) -> tuple[Any, Manifest, dict, dict]:
        """Every rank: read and check the manifest and ``.metadata``, build fresh buffers; agree on problems."""
        opts = self.settings.storage_options
        problem = None
        try:
            manifest = self._read_manifest(rec)
            reader = make_reader(rec.path, opts, manifest if self.settings.verify != "none" else None)
            metadata = reader.read_metadata()
            _check_world_size(manifest, metadata)
            template, wanted = state.load_template(metadata, manifest.world_size)
        except StateMismatchError as e:
            problem = ("mismatch", str(e))
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException: fall back on it too
            if is_fatal(e):
                raise
            problem = ("unloadable", f"{describe(e)}")
        agreed = self._agree(problem)
        if agreed is not None:
            kind, msg = agreed
            raise StateMismatchError(msg) if kind == "mismatch" else _Unloadable(msg)
        return reader, manifest, template, wanted

    def _load_and_apply(self, rec: CheckpointInfo, state: TrainState) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        t0 = time.monotonic()
        reader, manifest, template, wanted = self._prepare_load(rec, state)
        try:
            dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self._pg)
        except BaseException as e:  # noqa: BLE001 - any load failure means: fall back
            if is_fatal(e):
                raise
            raise _Unloadable(f"loading failed: {describe(e)}") from e
        t1 = time.monotonic()
        flat, _ = flatten_state_dict({k: v for k, v in template.items() if k in ("model", "optim")})
        diffs = fp.compare(manifest.fingerprint, fp.global_entries(flat, self._pg))
        if diffs:
            raise _Unloadable("loaded tensors do not match the saved fingerprint: " + "; ".join(diffs[:5]))
        try:
            saved = state.saved_progress(template, wanted)
        except ValueError as e:
            raise _Unloadable(str(e)) from None
        _check_progress(manifest, saved)
        t2 = time.monotonic()
        state.apply(template, wanted, manifest.world_size)
        t3 = time.monotonic()
        after, _ = flatten_state_dict(state._model_optim())
        diffs = fp.compare(manifest.fingerprint, fp.global_entries(after, self._pg))
        self.last_restore_timings.update(
            load=t1 - t0, apply=t3 - t2, verify=(t2 - t1) + (time.monotonic() - t3))
        if diffs:
            raise RestoreError(
                f"after restoring step {rec.step} the model/optimizer state differs from what was saved: "
                + "; ".join(diffs[:5]))


def _check_world_size(manifest: Manifest, metadata: Any) -> None:
    """The manifest's world size is the number of ranks whose state the checkpoint holds."""
    from .state import RANK_KEY

    ranks = {k.split(".")[1] for k in metadata.state_dict_metadata if k.startswith(f"{RANK_KEY}.")}
    if ranks and len(ranks) != manifest.world_size:
        raise _Unloadable(f"the manifest says world size {manifest.world_size}, the checkpoint holds the state of "
                          f"{len(ranks)} rank(s)")


def _check_progress(manifest: Manifest, saved: tuple[int, int]) -> None:
    """The restored step and epoch are the manifest's (a manifest or a shard copied from elsewhere is not)."""
    step, epoch = saved
    if step != manifest.step or (manifest.epoch is not None and epoch != manifest.epoch):
        raise _Unloadable(f"the checkpoint's state is at step {step}, epoch {epoch}, its manifest says step "
                          f"{manifest.step}, epoch {manifest.epoch}: its files do not belong together")


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


class _Unloadable(Exception):
    pass


def _state_bytes(state: TrainState) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in _iter_tensors(state._model_optim()):
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _iter_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_tensors(v)
