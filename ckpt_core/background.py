"""Where asynchronous saves run: one checkpoint process shared by every ``Saver`` of this Python process, or a thread.

Why not ``dcp.async_save(..., async_checkpointer_type=PROCESS)``: torch keeps
ONE checkpoint process per Python process in a module global
(``torch/distributed/checkpoint/_async_process_executor.py``:
``_CHECKPOINT_PROCESS``), but every ``async_save`` call builds a new
``_ProcessBasedAsyncCheckpointExecutor`` with a thread of its own, which

* tests ``_CHECKPOINT_PROCESS is None`` on the caller's thread and assigns it
  on the executor's thread: two saves dispatched before the first process is
  up spawn two processes, and the one overwritten is terminated by
  ``_AsyncCheckpointProcess.__del__`` while a save may be using it;
* calls ``_CHECKPOINT_PROCESS.save()`` (``_send`` then ``_wait_for_response``:
  a bare ``Connection.recv``) from each executor thread at once: concurrent
  reads of one pipe tear messages (``UnpicklingError: invalid load key``, an
  ``EOFError`` reported as "Checkpoint background process is dead. Exit code:
  None") or hand one save's reply to another save's thread, which leaves the
  other thread in ``recv`` while the process waits for the next request:
  each waits for the other, forever;
* never replaces a process that died: every later save fails.

Several ``CheckpointManager`` objects in one process (notebooks, sweeps, test
suites, an ``Accelerator`` per run) dispatch concurrently, so this module owns
the process instead (torch's ``_AsyncCheckpointProcess``, never torch's
global, so code that uses ``dcp.async_save`` itself cannot disturb it):
requests go to it from ONE dispatcher thread, in order (the process serves
one request at a time anyway, so nothing is lost); it is started by the first
process-mode save, replaced when a save finds it dead, and it lives until
interpreter exit, whatever managers are created, closed or dropped.

The process is spawned without the training script (``_without_main``):
``spawn`` would otherwise run the script's top level in it first, its imports
(memory) and, in a script without a ``__main__`` guard, a second run.

Both modes write on daemon threads, not on ``concurrent.futures`` workers,
which the interpreter joins without a bound before ``atexit`` handlers run:
at exit the only wait for a save is ``CheckpointManager``'s bounded flush
(``wait_pending``), and Ctrl-C or a second SIGTERM ends it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

from .shared_refs import ReleaseHeld, ReleasingConnection, SentStorages

log = logging.getLogger("ckpt_core")

_PENDING_LOCK = threading.Lock()
_PENDING: set[Future] = set()
"""Futures of saves still writing, whoever dispatched them (a manager dropped without close() included)."""


def _track(fut: Future) -> Future:
    with _PENDING_LOCK:
        _PENDING.add(fut)
    fut.add_done_callback(abandon)
    return fut


def abandon(fut: Future) -> None:
    """Stop counting ``fut`` as pending: ``wait_pending`` no longer waits for it (done, or its wait was interrupted)."""
    with _PENDING_LOCK:
        _PENDING.discard(fut)


def is_pending(fut: Future) -> bool:
    with _PENDING_LOCK:
        return fut in _PENDING


def wait_pending(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for every save still writing; False if some did not finish (interpreter exit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _PENDING_LOCK:
            pending = list(_PENDING)
        if not pending:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            pending[0].exception(timeout=left)  # done: its callback drops it from the pending set
        except Exception:  # noqa: BLE001 - a timeout ends the loop above; a failed save is reported elsewhere
            pass


def run_on_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` on a daemon thread of its own (async_mode="thread"); its future."""
    fut: Future = Future()

    def body() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the training side through the future
            fut.set_exception(e)

    _track(fut)
    threading.Thread(target=body, name="ckpt-writer", daemon=True).start()
    return fut


@dataclass
class _Job:
    staged: Any
    writer: Any
    planner: Any
    init: Optional[Any]
    future: Future


class SharedCheckpointProcess:
    """The one DCP checkpoint process of this Python process and the one thread that talks to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()  # None: release held buffers
        self._thread: Optional[threading.Thread] = None
        self._proc: Any = None
        self._starts_queued = 0
        self._sent = SentStorages()

    def needs_start(self) -> bool:
        """Whether the next save must start the process: none is alive and no queued save starts one."""
        with self._lock:
            return self._starts_queued == 0 and not _alive(self._proc)

    def init_info(self, process_group: Any, control: Any, timeout_s: Optional[float] = None) -> Optional[Any]:
        """On the training thread, on every rank together: what the next save needs to (re)start the process.

        Starting is collective (DCP's ``_ProcessGroupInitInfo`` broadcasts a port,
        and the processes of all ranks form one gloo group), so with several ranks
        they agree first: if any rank's process is gone, every rank starts a new one.
        ``timeout_s`` bounds the collectives of the processes' group (and its set-up).
        """
        from torch.distributed.checkpoint._async_process_executor import _ProcessGroupInitInfo

        need = self.needs_start()
        if getattr(control, "world_size", 1) > 1:
            need = bool(control.all_max(int(need)))
        if not need:
            return None
        info = _ProcessGroupInitInfo(process_group)
        info.ckpt_timeout_s = timeout_s  # read by _bounded_subprocess in the new process
        return info

    def submit(self, staged: Any, writer: Any, planner: Any, init: Optional[Any]) -> Future:
        """Queue one save of the staged state dict; its future. ``init`` (from ``init_info``) restarts the process."""
        fut: Future = Future()
        with self._lock:
            if init is not None:
                self._starts_queued += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="ckpt-process-dispatch", daemon=True)
                self._thread.start()
        _track(fut)
        self._jobs.put(_Job(staged, writer, planner, init, fut))
        return fut

    def release_held(self) -> None:
        """After the saves queued so far, have the process let go of the staging buffers it holds (a manager
        closed: its buffers would otherwise stay mapped there until the next save or exit)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                return
        self._jobs.put(None)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the process (benchmarks, tests); the next process-mode save starts a new one."""
        with self._lock:
            proc, self._proc = self._proc, None
        _stop(proc, timeout_s)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._release()
                continue
            try:
                if job.future.set_running_or_notify_cancel():
                    self._run(job)
            finally:
                if job.init is not None:
                    with self._lock:
                        self._starts_queued -= 1
                del job  # the staged tensors are freed now, not when the next request arrives

    def _run(self, job: _Job) -> None:
        try:
            proc = self._process_for(job)
            result = proc.save(staged_state_dict=self._sent.wrap(job.staged), storage_writer=job.writer,
                               planner=job.planner)
        except BaseException as e:  # noqa: BLE001 - handed to the training side through the future
            self._sent.clear()  # what the process holds is unknown now: the next save sends every storage
            job.future.set_exception(e)
        else:
            job.future.set_result(result)

    def _release(self) -> None:
        held = len(self._sent) > 0
        self._sent.clear()
        with self._lock:
            proc = self._proc
        if held and _alive(proc):
            try:
                proc._process_pipe.send(ReleaseHeld())
            except OSError:  # the process is gone, and with it what it held
                pass

    def _process_for(self, job: _Job) -> Any:
        if job.init is not None:
            with self._lock:
                old, self._proc = self._proc, None
            _stop(old)
            self._sent.clear()
            proc = _bounded_process_class()(job.init)  # spawns it and waits until its process group is up
            with self._lock:
                self._proc = proc
            return proc
        with self._lock:
            proc = self._proc
        if not _alive(proc):
            code = getattr(getattr(proc, "_save_process", None), "exitcode", None)
            raise RuntimeError(f"the checkpoint writer process is dead (exit code {code}); the next save starts "
                               "a new one")
        return proc


def _bounded_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
    """The checkpoint process's main: torch's, with ``collective_timeout_s`` as its process group's timeout.

    torch's subprocess calls ``init_process_group`` without a timeout (30 minutes
    for gloo); in this process of its own, the default it falls back to is set first.
    It exits with its parent from the start, also while its process group is set up.
    """
    from torch.distributed import distributed_c10d
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    from .dcp_io import exit_with_parent

    exit_with_parent()  # here, not at import: while spawn imports the main module, the parent is not known yet

    timeout_s = getattr(pg_init_info, "ckpt_timeout_s", None)
    if timeout_s:
        distributed_c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    _AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, ReleasingConnection(parent_conn))


WRITER_PROCESS_NAME = "ckpt-writer-process"
"""The name of the checkpoint process: ``spawn`` starts it without the training script (``_without_main``)."""


def _without_main(get_preparation_data: Callable[[str], dict]) -> Callable[[str], dict]:
    """``multiprocessing.spawn.get_preparation_data`` that leaves the main module out for the writer process.

    A spawned process first runs the parent's main module (the training
    script) as ``__mp_main__``: every top-level import and statement of it
    (``import lightning``: 67 MB of memory; a top-level ``wandb.init()`` or log
    file). The writer needs none of it: its target and everything it
    unpickles come from importable modules (``Saver`` refuses state that
    names the script's own classes). Other processes are started unchanged.
    """
    def prepare(name: str) -> dict:
        data = get_preparation_data(name)
        if name == WRITER_PROCESS_NAME:
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    prepare.ckpt_core_without_main = True  # type: ignore[attr-defined]
    return prepare


def script_classes(obj: Any) -> list[str]:
    """The classes defined in the training script (``__main__``) of the values in ``obj`` (dicts, lists,
    tuples, sets walked): what the writer process, started without the script, could not unpickle."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, (dict, list, tuple, set, frozenset)):
            if id(value) in seen:  # a container met again (shared, or a cycle)
                continue
            seen.add(id(value))
            stack.extend([*value.keys(), *value.values()] if isinstance(value, dict) else value)
        if getattr(type(value), "__module__", None) == "__main__":
            found.add(f"__main__.{type(value).__qualname__}")
    return sorted(found)


def _install_without_main() -> None:
    from multiprocessing import spawn

    if not getattr(spawn.get_preparation_data, "ckpt_core_without_main", False):
        spawn.get_preparation_data = _without_main(spawn.get_preparation_data)


def _start_writer(self: Any, pg_init_info: Any) -> None:
    """torch's ``_AsyncCheckpointProcess.__init__``, the process named ``WRITER_PROCESS_NAME`` and
    started without the training script."""
    import torch.multiprocessing as mp
    from torch.distributed.checkpoint._async_process_executor import _CheckpointSaveProcessControlOpts

    _install_without_main()
    self.ctx = mp.get_context("spawn")
    self._process_pipe, child_end = self.ctx.Pipe()
    self._save_process = self.ctx.Process(target=_bounded_subprocess, args=(pg_init_info, child_end),
                                          name=WRITER_PROCESS_NAME, daemon=True)
    self._save_process.start()
    child_end.close()  # the parent's recv fails fast if the child dies
    # torch's bound: spawning and importing torch takes seconds on a busy node, beyond a collective timeout; a
    # hang in the new process group's set-up ends within ckpt_timeout_s there and comes back as its exception
    response = self._wait_for_response(timeout=1800)
    if response != _CheckpointSaveProcessControlOpts.INIT_COMPLETE:
        raise RuntimeError(f"the checkpoint writer process did not start: {response!r}")


def _bounded_process_class() -> type:
    """torch's ``_AsyncCheckpointProcess`` whose spawned process runs ``_bounded_subprocess``, started
    without the training script (``_start_writer``)."""
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    global _BOUNDED
    if _BOUNDED is None:
        _BOUNDED = type("BoundedCheckpointProcess", (_AsyncCheckpointProcess,),
                        {"__init__": _start_writer,
                         "_checkpointing_subprocess": staticmethod(_bounded_subprocess)})
    return _BOUNDED


_BOUNDED: Optional[type] = None


def _alive(proc: Any) -> bool:
    return proc is not None and proc._save_process.is_alive()


def _stop(proc: Any, timeout_s: float = 5.0) -> None:
    """Ask a checkpoint process to exit; terminate it if it does not within ``timeout_s``."""
    if proc is None:
        return
    from torch.distributed.checkpoint._async_process_executor import _CheckpointSaveProcessControlOpts

    p = proc._save_process
    if p.is_alive():
        try:
            proc._send(_CheckpointSaveProcessControlOpts.TERMINATE)
        except (OSError, ValueError):
            pass
        p.join(timeout_s)
        if p.is_alive():
            log.warning("ckpt_core: the checkpoint writer process did not exit; terminating it")
            p.terminate()
            p.join(timeout_s)
    try:
        proc._process_pipe.close()
    except OSError:
        pass


PROCESS = SharedCheckpointProcess()
"""The checkpoint process of this Python process (async_mode="process")."""
