"""``RankGroup``: the few collectives the checkpoint code issues, and an in-process fake that checks them.

Every decision that ranks must take alike (is the save in flight done
everywhere? is a save due by rank 0's clock? which rank saw a problem?) goes
through a ``RankGroup``. ``TorchRankGroup`` runs them on a gloo process group
(bounded by the group's timeout); ``run_ranks`` runs N ranks on threads over
fake groups that fail, naming both call sites, when ranks issue different
collectives, in another order or on other groups, or when one rank returns
while another waits: the mistakes that hang real jobs, caught in a unit test.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist


log = logging.getLogger("ckpt_core")


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives at the same position (a real job would hang or mix data)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than its timeout for the other ranks."""


class RankGroup(Protocol):
    """What the checkpoint code needs from a process group."""

    rank: int
    world_size: int

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_min(self, value: int) -> int: ...

    def all_max(self, value: int) -> int: ...

    def all_gather(self, obj: Any) -> list: ...

    def start_all_max(self, values: list[int]) -> Callable[[], list[int]]: ...


class TorchRankGroup:
    """``RankGroup`` over a ``torch.distributed`` group; one rank (no group) answers locally."""

    def __init__(self, group: Any = None, *, enabled: Optional[bool] = None) -> None:
        on = dist.is_available() and dist.is_initialized() if enabled is None else enabled
        self.group = group
        self.rank = dist.get_rank() if on else 0
        self.world_size = dist.get_world_size(group) if on else 1
        self._on = on and self.world_size > 1
        self._bufs: dict[tuple[bool, int], torch.Tensor] = {}  # start_all_max's buffers
        self._flip = False

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._on:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def _reduce(self, value: int, op: Any) -> int:
        if not self._on:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.group)
        return int(t.item())

    def all_min(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MIN)

    def all_max(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MAX)

    def all_gather(self, obj: Any) -> list:
        if not self._on:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def start_all_max(self, values: list[int]) -> Callable[[], list[int]]:
        """Start the element-wise max of ``values`` over ranks without waiting; call the result to read it."""
        if not self._on:
            return lambda: list(values)
        self._flip = not self._flip  # two buffers: the previous one may still be in flight
        t = self._bufs.get((self._flip, len(values)))
        if t is None:
            t = self._bufs[(self._flip, len(values))] = torch.zeros(len(values), dtype=torch.int64)
        t.numpy()[:] = values  # no torch op on the training thread
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def result() -> list[int]:
            work.wait()
            return t.numpy().tolist()
        return result


# ------------------------------------------------------------------ decisions
def all_done(group: RankGroup, done: bool) -> bool:
    """Whether ``done`` holds on every rank (every rank takes the same branch)."""
    return bool(group.all_min(int(done)))


def exchange_every(call_interval_s: float, target_s: float, max_every: int) -> int:
    """Calls between two flag exchanges: enough that one exchange spans about ``target_s``, at most ``max_every``.

    Steps of ``target_s`` or longer exchange at every call (a step later); 5 ms
    steps exchange every 4th call at a 20 ms target, so the all-reduce (about
    100 us of dispatch) costs a quarter of that per call. ``max_every`` bounds
    how late a preemption signal is acted on: ``2 * max_every`` steps.
    """
    if not call_interval_s > 0:
        return max_every
    return max(1, min(max_every, math.ceil(target_s / call_interval_s)))


class StepFlags:
    """Flags every rank must see alike (a preemption signal, rank 0's clock), exchanged without a wait.

    At an exchange call, ``begin`` returns the result of the previous exchange
    and ``end`` starts an element-wise max over ranks of this call's flags:
    the all-reduce runs while the steps compute, so a call never blocks on a
    collective (it waits only for a rank far behind). Calls between exchanges
    issue no collective at all. Every rank counts calls alike, and the cadence
    (``every``) is rank 0's proposal, read by every rank from the same
    exchange, so every rank reads the same flags at the same call: at most
    ``2 * every`` calls after they were raised.
    """

    def __init__(self, group: RankGroup, target_s: float = 0.02, max_every: int = 8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._group = group
        self._pending: Optional[Callable[[], list[int]]] = None
        self._target_s, self._max_every, self._clock = target_s, max_every, clock
        self.every = 1
        """Calls from one exchange to the next, as agreed at the last exchange."""
        self._since = 0
        self._span = 1  # calls from the previous exchange to this one
        self._exchanging = False
        self._issued_at: Optional[float] = None

    def begin(self) -> Optional[list[int]]:
        """At a call's start: the flags of the previous exchange when this call exchanges, else None."""
        self._since += 1
        self._exchanging = self._since >= self.every
        if not self._exchanging:
            return None
        self._span, self._since = self._since, 0
        result = self.drain()
        if result is None:
            return None
        self.every = max(1, min(self._max_every, result[-1]))
        return result[:-1]

    def end(self, values: Callable[[], list[int]]) -> None:
        """At a call's end, if it exchanges: start the max over ranks of ``values()`` (with rank 0's cadence)."""
        if not self._exchanging:
            return
        self._exchanging = False
        now, proposal = self._clock(), int(self._group.rank == 0)  # the max is rank 0's: the others send 0
        if proposal and self._issued_at is not None:
            proposal = exchange_every((now - self._issued_at) / self._span, self._target_s, self._max_every)
        self._issued_at = now
        self._pending = self._group.start_all_max([*values(), proposal])

    def drain(self) -> Optional[list[int]]:
        """The result of the exchange still in flight (None if there is none); the group is idle afterwards."""
        pending, self._pending = self._pending, None
        return pending() if pending is not None else None


def first_problem(group: RankGroup, problem: Optional[tuple[str, str]]) -> Optional[tuple[str, str]]:
    """The lowest rank's ``(kind, message)`` problem on every rank; other ranks' messages name that rank."""
    for rank, p in enumerate(group.all_gather(problem)):
        if p is not None:
            return (p[0], p[1] if rank == group.rank else f"rank {rank}: {p[1]}")
    return None


# ----------------------------------------------------------------------- fake
@dataclass
class _Call:
    rank: int
    op: str
    group: str
    site: str
    value: Any


@dataclass
class _Hub:
    world_size: int
    timeout_s: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    calls: dict = field(default_factory=dict)  # position -> {rank: _Call}
    results: dict = field(default_factory=dict)  # position -> list of values by rank
    positions: list = field(default_factory=list)
    finished: dict = field(default_factory=dict)  # rank -> call site of its return
    error: Optional[BaseException] = None


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename != __file__:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"  # pragma: no cover


class FakeRankGroup:
    """One rank's view of a fake group (``run_ranks`` hands these out); same API as ``TorchRankGroup``."""

    def __init__(self, hub: _Hub, rank: int, name: str = "default") -> None:
        self._hub, self.rank, self.world_size, self.name = hub, rank, hub.world_size, name

    def subgroup(self, name: str) -> "FakeRankGroup":
        """Another group over the same ranks (like a second ``new_group``); calls on it are told apart."""
        return FakeRankGroup(self._hub, self.rank, name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collective(f"broadcast(src={src})", obj)[src]

    def all_min(self, value: int) -> int:
        return min(self._collective("all_min", int(value)))

    def all_max(self, value: int) -> int:
        return max(self._collective("all_max", int(value)))

    def all_gather(self, obj: Any) -> list:
        return list(self._collective("all_gather", obj))

    def start_all_max(self, values: list[int]) -> Callable[[], list[int]]:
        rows = self._collective("start_all_max", list(values))
        out = [max(col) for col in zip(*rows)]
        return lambda: out

    def _collective(self, op: str, value: Any) -> list:
        hub, call = self._hub, _Call(self.rank, op, self.name, _site(), value)
        with hub.cond:
            pos = hub.positions[self.rank]
            hub.positions[self.rank] += 1
            hub.calls.setdefault(pos, {})[self.rank] = call
            _check(hub, pos)
            hub.cond.notify_all()
            if not hub.cond.wait_for(lambda: hub.error is not None or pos in hub.results, timeout=hub.timeout_s):
                waiting = ", ".join(f"rank {c.rank} at {c.site}" for c in hub.calls[pos].values())
                hub.error = CollectiveTimeout(f"{op} on group {self.name!r} waited {hub.timeout_s}s: {waiting}; "
                                              f"the other ranks never issued it")
                hub.cond.notify_all()
            if hub.error is not None:
                raise hub.error
            return hub.results[pos]


def _check(hub: _Hub, pos: int) -> None:
    """Called with the lock held: compare the calls at ``pos``; complete it when every rank is there."""
    calls = hub.calls[pos]
    first = calls[min(calls)]
    for c in calls.values():
        if (c.op, c.group) != (first.op, first.group):
            hub.error = CollectiveMismatch(
                f"collective #{pos}: rank {first.rank} issued {first.op} on group {first.group!r} at {first.site}, "
                f"rank {c.rank} issued {c.op} on group {c.group!r} at {c.site}")
    for rank, site in hub.finished.items():
        hub.error = hub.error or CollectiveMismatch(
            f"collective #{pos}: rank {first.rank} issued {first.op} at {first.site}, but rank {rank} returned "
            f"at {site} without issuing it")
    if len(calls) == hub.world_size and hub.error is None:
        hub.results[pos] = [calls[r].value for r in range(hub.world_size)]


def run_ranks(world_size: int, fn: Callable[[FakeRankGroup], Any], timeout_s: float = 10.0) -> list:
    """Run ``fn(group)`` for every rank on its own thread over one fake hub; their return values by rank.

    Raises ``CollectiveMismatch`` / ``CollectiveTimeout`` (naming the call sites) when the ranks'
    collectives do not line up, and re-raises the first exception a rank raised.
    """
    hub = _Hub(world_size, timeout_s, positions=[0] * world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(FakeRankGroup(hub, rank))
        except BaseException as e:  # noqa: BLE001 - reported below, by rank
            errors[rank] = e
        with hub.cond:
            hub.finished[rank] = _site_of_return(hub, rank)
            for pos, calls in hub.calls.items():
                if pos not in hub.results and rank not in calls and hub.error is None:
                    _check(hub, pos)
            hub.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    if hub.error is not None:
        raise hub.error
    for e in errors:
        if e is not None:
            raise e
    return results


def _site_of_return(hub: _Hub, rank: int) -> str:
    return f"its return after {hub.positions[rank]} collective(s)"


# ------------------------------------------------------------- real groups
def ensure_process_group() -> None:
    """DCP's background process needs a process group; give a lone process a 1-rank gloo one."""
    if dist.is_available() and dist.is_initialized():
        return
    from torch.distributed.elastic.utils.distributed import get_free_port

    store = dist.TCPStore("127.0.0.1", get_free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    log.info("ckpt_core: started a 1-rank gloo process group for the background checkpoint process")


def checkpoint_groups(async_mode: str, timeout_s: float = 300.0) -> tuple[Any, Any]:
    """``(data group, control group)``: gloo groups of their own for the checkpoint code (None on one rank).

    DCP's collectives run on the data group; in ``thread`` and ``bytes`` modes they run on a
    background thread, so the training thread's agreements (preemption, "save
    done?", time sync) use a second group: two threads issuing collectives on
    one gloo group mismatch them and hang. Every collective on them waits at
    most ``timeout_s`` (``collective_timeout_s``; gloo's default is 30 minutes).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None, None
    timeout = timedelta(seconds=timeout_s)
    data = dist.new_group(backend="gloo", timeout=timeout)
    return data, dist.new_group(backend="gloo", timeout=timeout) if async_mode in ("thread", "bytes") else data


def release_groups(*groups: Any) -> None:
    """Destroy the given process groups of the checkpoint code (``checkpoint_groups``), each once; never the default.

    Only when no collective of theirs is running. Their gloo worker threads are joined
    (the last reference is dropped from Python, without the GIL), not left to interpreter exit.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.distributed_c10d._world
    default = dist.distributed_c10d._get_default_group()
    seen: set[int] = set()
    for group in groups:
        if group is None or group is default or id(group) in seen or group not in world.pg_map:
            continue
        seen.add(id(group))
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - a group that cannot be destroyed is left to the interpreter's exit
            log.debug("ckpt_core: could not destroy a checkpoint process group: %s", e)
