"""The saver: stage and write one checkpoint at a time, synchronously or in DCP's background process or thread.

It owns DCP's stager (host buffers reused from save to save, large ones page-aligned: ``staging``), chooses the
mode of each save (``async_mode``, or synchronous when the state exceeds
``max_host_memory_bytes``), and tracks the save in flight. What a save
contains and when it is due are the manager's business; commit bookkeeping
happens when the manager collects a finished save.

Staging happens here, on the training thread; the write then runs where
``background`` says: the checkpoint process shared by every saver of this
Python process (``async_mode="process"``: requests go to it one at a time, so
any number of managers can save concurrently), or a daemon thread; with
``async_mode="bytes"`` the thread hands each data file's bytes to the byte
writer process (``byte_client``).
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from .planner import LinearMergePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from . import background, byte_client
from .collectives import RankGroup, all_done
from .config import CheckpointSettings
from . import signing
from .dcp_io import LocalCommitWriter, make_writer
from .errors import SaveError, is_fatal
from .shared_arena import ARENA
from .staging import AlignedStager
from .state import TrainState

log = logging.getLogger("ckpt_core")


def alert_metrics(age_s: Optional[float], failed_saves: int, fallbacks: int) -> dict[str, float]:
    """The alert metrics: age of the newest committed checkpoint, failed saves in a row, restore fallbacks."""
    return {"ckpt/failed_saves": float(failed_saves), "ckpt/fallbacks": float(fallbacks),
            **({"ckpt/age_s": float(age_s)} if age_s is not None else {})}


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
    wait_s: float = 0.0  # waiting for the previous save to finish writing, before ``blocking_s`` began
    deleted: list = field(default_factory=list)
    first: bool = False
    failed: bool = False  # this save failed (``on_save_error="warn"``): only the alert metrics are reported
    age_s: Optional[float] = None  # seconds since the newest committed checkpoint, before this one committed
    failed_saves: int = 0  # consecutive failed saves, this one included
    fallbacks: int = 0  # checkpoints skipped at the last restore

    @property
    def throughput_bytes_per_s(self) -> Optional[float]:
        return self.bytes / self.write_s if self.write_s else None

    def as_metrics(self) -> dict[str, float]:
        alerts = alert_metrics(self.age_s, self.failed_saves, self.fallbacks)
        if self.failed:
            return {"ckpt/step": float(self.step), **alerts}
        out = {"ckpt/step": float(self.step), "ckpt/blocking_s": self.blocking_s, "ckpt/wait_s": self.wait_s,
               "ckpt/bytes": float(self.bytes), **alerts}
        if self.write_s is not None:
            out["ckpt/write_s"] = self.write_s
        if self.throughput_bytes_per_s is not None:
            out["ckpt/throughput_MBps"] = self.throughput_bytes_per_s / 1e6
        if self.interval_s is not None:
            out["ckpt/interval_s"] = self.interval_s
        out["ckpt/deleted"] = float(len(self.deleted))
        return out


@dataclass
class InFlight:
    """A save that was dispatched and is not collected yet."""

    step: int
    future: Future
    stats: SaveStats
    t_dispatch: float
    synchronous: bool = False
    t_done: Optional[float] = None


class Saver:
    """Dispatches saves (``start``) and hands back finished ones (``collect``); one in flight at a time."""

    def __init__(self, settings: CheckpointSettings, process_group: Any, control: RankGroup) -> None:
        self.settings, self._pg, self._control = settings, process_group, control
        self._signing_key = signing.settings_key(settings)
        self.inflight: Optional[InFlight] = None
        self.reserved_host_bytes: Callable[[int], int] = lambda state_nbytes: 0
        """Host memory held elsewhere for a state of this size (the local tier's slots), within the budget."""
        self._plan_key = f"ckpt_core.Saver-{uuid.uuid4().hex}"
        self.stager: Optional[AlignedStager] = None
        if settings.async_mode != "off":
            self.stager = AlignedStager(StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=settings.async_mode == "process",
                use_async_staging=False,
                use_non_blocking_copy=False,
            ), arena=settings.async_mode == "bytes")

    def done_everywhere(self) -> bool:
        """Whether no rank has a save still writing (collective: every rank takes the same branch)."""
        return all_done(self._control, self.inflight is None or self.inflight.future.done())

    def start(self, step: int, state: TrainState, path: str, fields: dict, stats: SaveStats) -> InFlight:
        """Write ``state`` to ``path`` (collective); the save in flight. ``SaveError`` if it could not start."""
        s = self.settings
        t0 = time.monotonic()
        try:
            writer = make_writer(path, fields, storage_options=s.storage_options, thread_count=s.writer_threads,
                                 retries=s.write_retries, backoff_s=s.retry_backoff_s,
                                 signing_key=self._signing_key, nice=s.writer_nice, direct_io=s.direct_io)
            mode = self._mode_for(state)
            fut = self._dispatch(mode, state, writer, self._planner())
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if is_fatal(e):
                raise
            raise SaveError(step, e) from None
        stats.blocking_s = time.monotonic() - t0
        inflight = InFlight(step=step, future=fut, stats=stats, t_dispatch=t0, synchronous=mode == "off")
        fut.add_done_callback(lambda _f, i=inflight: setattr(i, "t_done", time.monotonic()))
        self.inflight = inflight
        return inflight

    def collect(self, block: bool) -> Optional[InFlight]:
        """The save in flight once it finished (or after waiting for it), else None; ``SaveError`` if it failed."""
        inflight = self.inflight
        if inflight is None or (not block and not inflight.future.done()):
            return None
        try:
            inflight.future.result()
        except BaseException as e:  # noqa: BLE001 - reported on the training side
            if is_fatal(e):  # Ctrl-C while waiting stops the program, whatever on_save_error says
                if inflight.future.done():
                    self.inflight = None
                else:  # still writing from the staging buffers: keep it in flight, but never wait for it at exit
                    background.abandon(inflight.future)
                raise
            self.inflight = None
            raise SaveError(inflight.step, e) from None
        self.inflight = None
        inflight.stats.write_s = (inflight.t_done or time.monotonic()) - inflight.t_dispatch
        return inflight

    def finish_within(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the save in flight (interpreter exit); False if it is still writing."""
        if self.inflight is None:
            return True
        if not self.inflight.future.done() and not background.is_pending(self.inflight.future):
            return False  # a Ctrl-C interrupted the wait for it: the program is stopping
        try:
            self.inflight.future.result(timeout=max(timeout_s, 0.0))
        except FutureTimeout:
            log.warning("ckpt_core: the save at step %d did not finish within %.0fs of exit; it stays "
                        "uncommitted", self.inflight.step, timeout_s)
            return False
        except BaseException as e:  # noqa: BLE001 - reported by collect()
            if is_fatal(e):
                raise
        return True

    def _planner(self) -> LinearMergePlanner:
        """DCP's planner with plan caching under a key of this saver's own.

        DCP caches plans in class attributes under the planner's class name: two
        managers of one process saving different states would swap cached plans
        ("Could not find FQN" in the middle of a write).
        """
        planner = LinearMergePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plan_key
        return planner

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.settings.async_mode == "process":
            background.PROCESS.release_held()
        if self.settings.async_mode == "bytes":
            ARENA.trim()
            byte_client.PROCESS.release_freed()
        for cache in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                      "_cached_final_save_plan"):
            getattr(SavePlanner, cache, {}).pop(self._plan_key, None)

    def _dispatch(self, mode: str, state: TrainState, writer: Any, planner: Any) -> Future:
        """Run the save synchronously (``off``), or stage it here and write it in the background; a future.

        Not ``dcp.async_save``: in process mode it would share torch's one checkpoint
        process unsafely between managers, and its writer threads are joined without
        a bound at interpreter exit (``background`` explains both).
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if mode == "off":
                dcp.save(state.state_dict(), storage_writer=writer, planner=planner, process_group=self._pg)
                fut: Future = Future()
                fut.set_result(None)
                return fut
            assert self.stager is not None
            plain = _plain_state_dict(state.state_dict())
            if mode == "process":
                self._refuse_script_classes(plain)
            staged = self.stager.stage(plain)
            if mode == "process":
                init = background.PROCESS.init_info(self._pg, self._control,  # collective when ranks > 1
                                                     self.settings.collective_timeout_s)
                return background.PROCESS.submit(staged, writer, planner, init)
            if mode == "bytes" and isinstance(writer, LocalCommitWriter):
                writer.fs.remote = byte_client.RemoteSave(byte_client.PROCESS, self.settings.writer_nice)
            return background.run_on_thread(dcp.save, staged, storage_writer=writer, planner=planner,
                                            process_group=self._pg)

    def _refuse_script_classes(self, state_dict: dict) -> None:
        """Raise if a rank's state holds objects of classes of the training script, which the writer process
        (started without the script) could not unpickle; collective: every rank refuses together."""
        named = background.script_classes(state_dict)
        if any(self._control.all_gather(bool(named))):
            raise ValueError(
                f"the state holds objects of classes defined in the training script "
                f"({', '.join(named) or 'on another rank'}); the checkpoint writer process does not run the script, "
                "so it cannot unpickle them: define them in an importable module, or save with async_mode='thread' or "
                "async_mode='bytes'")

    def _mode_for(self, state: TrainState) -> str:
        mode, limit = self.settings.async_mode, self.settings.max_host_memory_bytes
        if mode != "off" and limit is not None:
            nbytes = state_bytes(state)
            reserved = self.reserved_host_bytes(nbytes)
            # collective: ranks of uneven shards agree, so that none writes synchronously while the others
            # hand their writes to the background (their collectives would never meet)
            if any(self._control.all_gather(nbytes + reserved > limit)):
                held = f" with the local tier's {reserved} bytes of slots" if reserved else ""
                log.warning("ckpt_core: a staging copy of %d bytes%s exceeds max_host_memory_bytes=%d; saving "
                            "synchronously (no staging copy) instead of asynchronously", nbytes, held, limit)
                return "off"
        return mode


def _plain_state_dict(state_dict: dict) -> dict:
    """A shallow copy, every ``Stateful`` value replaced by its ``state_dict()`` (what ``dcp.async_save`` stages)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def state_bytes(state: TrainState) -> int:
    """Bytes of this rank's model and optimizer tensors (local shards of DTensors)."""
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
