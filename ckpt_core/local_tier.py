"""The local tier: snapshots in node memory every few steps, replicated to peer nodes, recovered first.

``LocalTier.snapshot`` copies this rank's state into a memory-mapped slot
file under ``local_dir`` (the stall: one host copy); a background thread
seals it (CRC32C, fingerprint), commits its record and sends it to the ranks
on other nodes that keep its replicas (``local_layout``), committing theirs
as they arrive. ``LocalTier.recover`` (collective, ``local_recovery``) finds
the newest step that every rank's snapshot is held for on some node, moves
the missing ones over the network, checks and applies them; anything else
goes to the durable tier.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import threading
import time
from dataclasses import replace
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from . import local_layout as layout
from . import local_snapshot as snap
from .collectives import RankGroup, all_done, first_problem
from .config import CheckpointSettings
from .errors import describe
from .local_record import HOST_RE, default_local_dir, job_key
from .schedule import SaveSchedule
from .local_transfer import Incoming, Outgoing, exchange
from .state import TrainState

log = logging.getLogger("ckpt_core")

DOCKER_HINT = ("containers often get a 64 MiB /dev/shm by default (docker run --shm-size, a Kubernetes emptyDir with "
               "medium: Memory); give it more room, lower local_keep, or set local_dir to another directory")


_HOSTNAME = socket.gethostname()
_HOST = _HOSTNAME if HOST_RE.match(_HOSTNAME) else ""

LOCAL_MIN_INTERVAL_S = 0.01
"""Lower clamp of ``local_interval="auto"``: the measured checksum+replication time is the real floor."""


class LocalTierError(RuntimeError):
    """The local tier cannot run as configured (no room, an unsafe directory); raised before training starts."""


def _before_replica_commit(owner: int, step: int) -> None:
    """Called before a received replica is committed (tests replace it to stop a run mid-replication)."""


class LocalTier:
    """This rank's side of the local tier; every rank makes one (collective use, like the manager)."""

    def __init__(self, settings: CheckpointSettings, rank: int, world_size: int, run_id: str, group: RankGroup,
                 process_group: Any) -> None:
        self.keep = settings.local_keep
        self.schedule = SaveSchedule(
            every_n_steps=settings.local_every_n_steps, every_seconds=settings.local_every_seconds,
            interval=settings.local_interval, device_mtbf_hours=settings.device_mtbf_hours,
            n_devices=settings.n_devices or world_size, min_interval_s=LOCAL_MIN_INTERVAL_S,
            max_interval_s=settings.max_interval_s)
        self.rank, self.world_size = rank, world_size
        env_size = os.environ.get("LOCAL_WORLD_SIZE", "")
        from_env = int(env_size) if env_size.isdigit() else None
        self.node_size = settings.local_node_size or from_env or world_size
        self._node_from_env = settings.local_node_size is None and from_env is not None
        self.factor = settings.replication_factor or layout.default_factor(world_size, self.node_size)
        problem = layout.layout_problem(world_size, self.node_size, self.factor)
        if problem is not None:
            raise LocalTierError(f"local tier: {problem}")
        self.root = os.path.abspath(settings.local_dir or default_local_dir())
        self.job = job_key(run_id)
        self.job_dir = os.path.join(self.root, self.job)
        self.cleanup_at_end = settings.local_cleanup
        self.host_limit = settings.max_host_memory_bytes
        self.skip_in_flight = settings.on_in_flight == "skip"
        self.skipped: list[int] = []  # steps not snapshotted: the previous one was still in the background
        self._group, self.process_group = group, process_group
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-local")
        self._pending: Optional[Future] = None
        self._slots: dict[int, dict[int, Optional[int]]] = {}  # owner -> slot -> committed step
        self._maps: dict[str, torch.Tensor] = {}  # slot path -> its mapping (reused while the size stays)
        self._lock = threading.Lock()
        self._own_bytes: Optional[int] = None  # this rank's snapshot size, measured at the space check
        self._started = False
        self.last_step: Optional[int] = None
        self.timings: dict[str, float] = {}  # of the last recovery (``local_recovery.Recovery.timings``)
        self.steps: list[int] = []  # the steps snapshotted by this run
        self._last_time = time.monotonic()
        self._written_s: Optional[float] = None  # the last snapshot's seal + replication time, not yet recorded
        self.last_stall_s = 0.0
        self.last_error: Optional[BaseException] = None

    # ------------------------------------------------------------- files
    def owner_dir(self, owner: int) -> str:
        return os.path.join(self.job_dir, f"rank_{owner}")

    def _ensure_dirs(self, owner: int) -> str:
        for d in (self.root, self.job_dir, self.owner_dir(owner)):
            os.makedirs(d, mode=0o700, exist_ok=True)
            _check_private(d)
        return self.owner_dir(owner)

    def _slot_map(self, owner: int) -> dict[int, Optional[int]]:
        """Slot -> the step whose record points at it, read from the owner directory once (then kept up to date).

        A record that cannot be read, or that points at a slot a newer record also points at (its bytes were
        overwritten), is removed here, so that the map accounts for every record of the rotating slots.
        """
        with self._lock:
            if owner not in self._slots:
                directory = self.owner_dir(owner)
                slots: dict[int, Optional[int]] = {k: None for k in range(self.keep + 1)}
                for step, path in sorted(snap.list_records(directory).items()):
                    rec = snap.read_record(path)
                    if rec is None:
                        snap.uncommit(directory, step)
                    elif rec.slot in slots:
                        if slots[rec.slot] is not None:
                            snap.uncommit(directory, slots[rec.slot])  # type: ignore[arg-type]
                        slots[rec.slot] = step
                self._slots[owner] = slots
            return self._slots[owner]

    def _claim_slot(self, owner: int, nbytes: int) -> tuple[int, torch.Tensor]:
        """A slot to write ``owner``'s next snapshot into (its old record removed first), mapped."""
        directory = self._ensure_dirs(owner)
        slots = self._slot_map(owner)
        k = layout.slot_to_reuse(slots)
        if slots[k] is not None:
            snap.uncommit(directory, slots[k])  # type: ignore[arg-type]
        slots[k] = None
        path = snap.slot_path(directory, k)
        mapped = self._maps.get(path)
        if mapped is None or mapped.numel() != nbytes:
            self._maps.pop(path, None)
            mapped = self._maps[path] = snap.open_slot(path, nbytes)
        return k, mapped

    # -------------------------------------------------------------- save
    def time_due(self) -> bool:
        """The time triggers on this rank's clock (rank 0's answer is the one every rank acts on)."""
        return self.schedule.needs_time_sync and self.schedule.time_due(time.monotonic() - self._last_time)

    def due(self, step: int, time_flag: bool = False) -> bool:
        """Whether ``step`` is snapshotted: the step trigger, or the agreed time flag (``time_due``)."""
        return step != self.last_step and (self.schedule.step_due(step) or time_flag)

    def poll(self) -> None:
        """Collect the background work of the last snapshot if it finished (its time feeds the schedule)."""
        if self._pending is not None and self._pending.done():
            self._wait_pending()

    def snapshot(self, step: int, state: TrainState) -> bool:
        """Stage this rank's state (collective: every rank at the same steps); the rest runs in the background.

        A rank whose staging fails still takes part in the replication round (sending nothing), so that
        its peers' rounds end; the durable tier goes on protecting the run.
        """
        t0 = time.monotonic()
        if self.skip_in_flight and not self._all_idle():
            self.skipped.append(step)
            log.info("ckpt_core: local snapshot of step %d skipped: the snapshot of step %s is still being sealed or "
                     "replicated (on_in_flight='skip')", step, self.last_step)
            return False
        self._wait_pending()
        state.step = step
        cap = snap.capture(state)
        if not self._started:  # no restore ran: snapshots left by an earlier incarnation of the job do not count
            self.after_restore(None)
        if self._own_bytes is None:
            self.check_space(cap.data_bytes + len(cap.small) + len(cap.others))
        self.last_step = step
        self.steps.append(step)
        staged: Optional[tuple[int, torch.Tensor]] = None
        try:
            staged = self._claim_slot(self.rank, cap.data_bytes)
            snap.stage(cap, staged[1])
        except OSError as e:
            self._failed(step, e)
            staged = None
        self._pending = self._pool.submit(self._seal_and_replicate, step, cap, staged)
        self._last_time = time.monotonic()
        self.last_stall_s = self._last_time - t0
        self.schedule.record_cost(self.last_stall_s)
        return staged is not None

    def _all_idle(self) -> bool:
        """Whether no rank's previous snapshot is still in the background (collective: all take one branch)."""
        return all_done(self._group, self._pending is None or self._pending.done())

    def wait(self) -> None:
        """Until the snapshot in flight is committed here and at its replicas (failures are logged, not raised)."""
        self._wait_pending()

    def _wait_pending(self) -> None:
        if self._pending is None:
            return
        try:
            self._pending.result()
        except Exception as e:  # noqa: BLE001 - reported; the durable tier still protects the run
            self._failed(self.last_step, e)
        self._pending = None
        if self._written_s is not None:
            self.schedule.record_write(self._written_s)
            self._written_s = None

    def _failed(self, step: Optional[int], e: BaseException) -> None:
        self.last_error = e
        log.warning("ckpt_core: local snapshot of step %s failed: %s; the durable tier still protects the run",
                    step, describe(e))

    def _seal_and_replicate(self, step: int, cap: snap.Capture, staged: Optional[tuple[int, torch.Tensor]]) -> None:
        """In the background: seal and commit the staged snapshot, then the replication round of ``step``."""
        t0 = time.monotonic()
        sent: Optional[Outgoing] = None
        if staged is not None:
            try:
                slot, data = staged
                rec = replace(snap.seal(cap, data, self.job, self.rank, self.world_size, slot), **self._held_here())
                extra = cap.small + cap.others
                snap.commit(self.owner_dir(self.rank), rec, extra)
                self._slot_map(self.rank)[slot] = rec.step
                sent = Outgoing(-1, rec.to_json(), data, extra)
            except (OSError, snap.SnapshotError) as e:
                self._failed(step, e)
        if self.factor > 1 and self.process_group is not None:
            self._replicate(step, sent)
        self._written_s = time.monotonic() - t0

    def _replicate(self, step: int, sent: Optional[Outgoing]) -> None:
        """Send this rank's snapshot (``sent``; None: nothing) to the ranks keeping its replicas; receive and
        commit the ones kept here."""
        targets = layout.replica_targets(self.rank, self.world_size, self.node_size, self.factor)
        outgoing = [Outgoing(dst, sent.record, sent.data, sent.extra) if sent is not None else Outgoing(dst)
                    for dst in targets]
        sources = layout.replica_sources(self.rank, self.world_size, self.node_size, self.factor)
        claimed: dict[int, Optional[int]] = {}

        def alloc(src: int, record: bytes, nbytes: int) -> torch.Tensor:
            try:
                slot, mapped = self._claim_slot(src, nbytes)
            except OSError as e:  # no room for the replica: receive it anyway (the sender waits), keep nothing
                log.warning("ckpt_core: no room for the replica of rank %d at step %d: %s", src, step, describe(e))
                claimed[src] = None
                return torch.empty(nbytes, dtype=torch.uint8)
            claimed[src] = slot
            return mapped

        for inc in exchange(self.process_group, outgoing, sources, alloc):
            slot = claimed.get(inc.src)
            if inc.record and slot is not None:
                self._commit_replica(inc, step, slot)

    def _commit_replica(self, inc: Incoming, step: int, slot: int) -> None:
        what = f"the replica of rank {inc.src}'s snapshot at step {step}"
        try:
            got = snap.parse_record(inc.record, what)
            if (got.job, got.owner, got.step, got.world_size) != (self.job, inc.src, step, self.world_size):
                raise snap.SnapshotError(f"{what} is a snapshot of rank {got.owner} at step {got.step}")
            snap.check_bytes(got, inc.data, inc.extra, what)
            _before_replica_commit(inc.src, step)
            snap.commit(self.owner_dir(inc.src), replace(got, slot=slot, **self._held_here()), inc.extra)
        except (OSError, snap.SnapshotError) as e:
            log.warning("ckpt_core: %s is not kept: %s", what, describe(e))
            return
        self._slot_map(inc.src)[slot] = step

    def _held_here(self) -> dict[str, Any]:
        """The record fields that say which rank, node and host keep a copy (what ``ckpt ls`` shows)."""
        return {"holder": self.rank, "node_size": self.node_size, "factor": self.factor, "host": _HOST}

    def check_space(self, own_bytes: int) -> None:
        """Collective: ``LocalTierError`` on every rank when some node's ``local_dir`` lacks the room it needs."""
        self._own_bytes = own_bytes
        need = layout.space_needed(own_bytes, self.keep, self.factor, self.node_size)
        problem = None
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            _check_private(self.root)
            free = shutil.disk_usage(self.root).free + _bytes_under(self.job_dir)
            if need > free:
                problem = ("space", f"local_dir {self.root} has {free / 2**20:.0f} MiB free, the local tier needs "
                                    f"{need / 2**20:.0f} MiB on this node ((local_keep {self.keep} + 1) x "
                                    f"{self.factor} copies x {self.node_size} ranks x {own_bytes / 2**20:.1f} MiB); "
                                    f"{DOCKER_HINT}")
        except (OSError, LocalTierError) as e:
            problem = ("dir", str(e))
        over = layout.budget_problem(own_bytes, self.keep, self.factor, self.host_limit)
        problem = problem or (("budget", f"local tier: {over}") if over else None) or self._layout_problem()
        agreed = first_problem(self._group, problem)
        if agreed is not None:
            raise LocalTierError(agreed[1])
        log.info("ckpt_core: local tier in %s: %s, keep %d, replication factor %d (%d ranks per node), up to %.1f "
                 "MiB of node memory per node", self.job_dir, _cadence(self.schedule), self.keep, self.factor,
                 self.node_size, need / 2**20)

    def _layout_problem(self) -> Optional[tuple[str, str]]:
        """Placement takes ranks ``n * node_size`` to ``(n + 1) * node_size - 1`` to share node ``n``; under
        torchrun, ``GROUP_RANK`` says which node a rank is on, and the two must agree."""
        group_rank = os.environ.get("GROUP_RANK", "")
        node = self.rank // self.node_size
        if not self._node_from_env or not group_rank.isdigit() or int(group_rank) == node:
            return None
        return ("layout", f"local tier: rank {self.rank} runs on node {group_rank} (GROUP_RANK) but LOCAL_WORLD_SIZE "
                          f"{self.node_size} places it on node {node}: the local tier's replica placement needs "
                          "every node to run the same number of ranks (the same torchrun --nproc-per-node)")

    def host_bytes(self, state_nbytes: int) -> int:
        """The host memory this rank's slots take (counted in ``max_host_memory_bytes`` next to the durable
        tier's staging copy): from the snapshot size measured at the space check, else ``state_nbytes``."""
        own = self._own_bytes if self._own_bytes is not None else state_nbytes
        return layout.host_bytes_per_rank(own, self.keep, self.factor)

    # ------------------------------------------------------------ recover
    def recover(self, state: TrainState, durable_step: Optional[int]) -> Optional[snap.SnapshotRecord]:
        """Restore the newest step every rank can restore from node memory, if newer than ``durable_step``
        (collective; ``local_recovery``). None: the durable tier decides (the log says why)."""
        from .local_recovery import Recovery

        self._wait_pending()
        self.check_space(_state_bytes(state))
        recovery = Recovery(self)
        try:
            return recovery.run(state, durable_step)
        finally:
            self.timings = recovery.timings

    # ---------------------------------------------------------- lifecycle
    def after_restore(self, step: Optional[int]) -> None:
        """Collective, before training goes on from ``step`` (None: from scratch): drop this job's snapshots of
        later steps (a run that did not continue), on every node, before any rank writes a new one."""
        self._forget_after(step)
        self._group.all_gather(None)
        self._started = True
        self._last_time = time.monotonic()

    def _forget_after(self, step: Optional[int]) -> None:
        for owner in layout.owners_scanned_by(self.rank, self.world_size, self.node_size):
            directory = self.owner_dir(owner)
            for s in snap.list_records(directory):
                if step is None or s > step:
                    snap.uncommit(directory, s)
        with self._lock:
            self._slots.clear()

    def close(self, completed: bool = False) -> None:
        """Finish the snapshot in flight; after a completed run (``local_cleanup``) remove this job's snapshots."""
        self._wait_pending()
        self._pool.shutdown(wait=True)
        self._maps.clear()
        if completed:
            self.remove_snapshots()

    def remove_snapshots(self) -> None:
        """Remove the snapshots this rank manages on its node (``local_cleanup``); not a collective.

        The owner directories a rank scans (``owners_scanned_by``) are written only by that rank: its
        own snapshots, and the replicas it receives (the replica of rank ``o`` on a node lands on the rank
        of that node with ``o``'s local index). Once its own background work is done, nothing writes
        there, so no rank waits for another; a call after ``close`` (the run turned out complete) works.
        """
        if not self.cleanup_at_end:
            return
        for owner in layout.owners_scanned_by(self.rank, self.world_size, self.node_size):
            shutil.rmtree(self.owner_dir(owner), ignore_errors=True)
        try:
            os.rmdir(self.job_dir)
        except OSError:
            pass  # the node's other ranks remove their owner directories themselves; the last one removes it


def _cadence(schedule: SaveSchedule) -> str:
    parts = [f"every {schedule.every_n_steps} steps"] if schedule.every_n_steps else []
    parts += [f"every {schedule.every_seconds:g} s"] if schedule.every_seconds else []
    parts += ["at the auto interval"] if schedule.auto else []
    return " or ".join(parts)


def local_group(world_size: int, timeout_s: float) -> Any:
    """The local tier's own gloo group (None on one rank): replication runs on it from a background thread, so
    it never shares a group with the training thread's collectives. Collective: every rank creates it."""
    import torch.distributed as dist
    from datetime import timedelta

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _check_private(path: str) -> None:
    """A directory the local tier reads must be this user's and not writable by others (``/dev/shm`` is shared)."""
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LocalTierError(f"local_dir {path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; "
                             "the local tier only uses a directory of its own user that others cannot write")


def _bytes_under(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _state_bytes(state: TrainState) -> int:
    cap_leaves = snap.capture(state)
    return cap_leaves.data_bytes + len(cap_leaves.small) + len(cap_leaves.others)

