"""Save benchmark: training stall, persist throughput, CPU, training overhead and host memory of every way to save.

    python -m benchmarks.save                 # 1 GiB state, 1 rank: 4 rounds of saves, 10 of the training loop
    python -m benchmarks.save --ranks 1 2     # also 2 ranks over gloo (state sharded, each rank holds half)
    python -m benchmarks.save --quick         # 64 MiB, 3 rounds, one worker for all rounds: a smoke run (1-2 min)

One run measures, on the same state (``--size-gib`` of fp32 tensors, the
parameters of a plain ``nn.Module``):

* variants that save it: ``torch.save`` on rank 0 + fsync (what Lightning's and
  Accelerate's defaults do; at 2 ranks after gathering the full state to rank
  0), stock ``dcp.save`` (FileSystemWriter), stock ``dcp.async_save`` (thread and
  process), and this project's ``CheckpointManager`` in ``process``, ``bytes``,
  ``thread`` and ``off`` (synchronous) mode, plus ``process`` with a host-memory budget
  below the state size (it then saves synchronously) and ``process`` with
  ``direct_io=False`` (``ckpt[process,buffered]``: data files through the page
  cache);
* the CPU time of each save, from ``/proc``: every process and thread of the
  rank (DCP's background writer process and its children included) from the
  save call until the checkpoint is durable, per GiB written, and the part the
  training thread spends inside the save call;
* the machine's own limits, in the same run: a warm ``copy_`` of the same bytes
  into preallocated host buffers (staging limit), an fsync'd sequential write
  of the same bytes (storage limit), and the CPU of the pieces of a write over
  the same bytes (staging copy, CRC32C, fingerprint, page-cache copy, fsync;
  the *floor* is page-cache copy + hardware CRC32C);
* the overhead on a toy training loop (matmuls, ``--loop-step-s`` per step) of
  a save every ``--loop-every`` steps (about 10 s of training by default), with
  every core busy and with one training thread (``--loop-threads``): periods
  with a save alternate with periods without one in the same process, so the
  shared machine's drift hits both alike.

Every variant runs in a fresh process per round (``--isolation variant``), so
its first save (process spawn, plan, buffer allocation) and its peak host
memory are its own; rounds are interleaved and the variant order rotates each
round. Every ratio is a ratio of totals over the rounds, each round's value
paired with its reference from the same round, with a 95 % bootstrap
confidence interval over the rounds; the table shows them, PASS/MISS against
the targets of issue 3, and the goals of issue 18 with whether the whole CI
meets each. Results: ``benchmarks/results/save_<timestamp>.json`` (+ ``--out``)
and a PNG when matplotlib is importable. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):  # allow ``python benchmarks/save.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _common as C  # noqa: E402

# ------------------------------------------------------------------ variants
LIMIT_COPY = "limit:copy"
LIMIT_WRITE = "limit:write"
TORCH_SAVE = "torch.save"
DCP_SAVE = "dcp.save"
DCP_ASYNC_THREAD = "dcp.async_save[thread]"
DCP_ASYNC_PROCESS = "dcp.async_save[process]"
CKPT_OFF = "ckpt[off]"
CKPT_THREAD = "ckpt[thread]"
CKPT_PROCESS = "ckpt[process]"
CKPT_BYTES = "ckpt[bytes]"
CKPT_BUDGET = "ckpt[process,budget]"
LOOP_PREFIX = "loop:"
CKPT_NICE0 = "ckpt[process,nice=0]"
CKPT_BUFFERED = "ckpt[process,buffered]"
LOOP_KINDS = (TORCH_SAVE, CKPT_OFF, CKPT_PROCESS, CKPT_BYTES, CKPT_THREAD, CKPT_NICE0, CKPT_BUFFERED)
DEFAULT_LOOP_KINDS = (TORCH_SAVE, CKPT_BYTES)
COMPONENTS = ("copy", "crc32c", "fingerprint", "pagecache", "fsync")
"""The pieces of a write whose CPU is measured on their own, as ``<name>_cpu_s`` in ``measure_refs``."""

DESCRIPTIONS = {
    LIMIT_COPY: "warm copy_ of the same bytes into preallocated host buffers (staging limit)",
    LIMIT_WRITE: "fsync'd sequential write of the same bytes, one file per rank (storage limit)",
    TORCH_SAVE: "torch.save of the full state on rank 0 + fsync (Lightning/Accelerate default)",
    DCP_SAVE: "stock dcp.save, FileSystemWriter defaults",
    DCP_ASYNC_THREAD: "stock dcp.async_save, thread executor, default stager (no buffer reuse)",
    DCP_ASYNC_PROCESS: "stock dcp.async_save, process executor, default stager (no buffer reuse)",
    CKPT_OFF: "CheckpointManager(async_mode='off'): synchronous DCP save + commit",
    CKPT_THREAD: "CheckpointManager(async_mode='thread')",
    CKPT_PROCESS: "CheckpointManager(async_mode='process'): DCP in a background process with torch",
    CKPT_BYTES: "CheckpointManager(async_mode='bytes'), the default: DCP on a thread, bytes written by a process "
                "without torch",
    CKPT_BUDGET: "CheckpointManager(async_mode='process', max_host_memory_bytes=state/2): saves synchronously",
    CKPT_NICE0: "CheckpointManager(async_mode='process', writer_nice=0): the writer at the trainer's priority",
    CKPT_BUFFERED: "CheckpointManager(async_mode='process', direct_io=False): data files through the page cache",
}


def ckpt_spec(name: str, default_wt: int) -> Optional[dict]:
    """``ckpt[process,wt=4,nice=0]`` -> {'mode': 'process', 'wt': 4, 'budget': False, 'nice': 0, 'direct': True};
    None for other variants (``nice`` None: the setting's default; ``buffered``: ``direct_io=False``)."""
    if not name.startswith("ckpt["):
        return None
    parts = name[5:-1].split(",")
    out = {"mode": parts[0], "wt": default_wt, "budget": False, "nice": None, "direct": True}
    for p in parts[1:]:
        if p == "budget":
            out["budget"] = True
        elif p == "buffered":
            out["direct"] = False
        elif p.startswith("wt="):
            out["wt"] = int(p[3:])
        elif p.startswith("nice="):
            out["nice"] = int(p[5:])
    return out


def save_variants(args: argparse.Namespace) -> list[str]:
    names = [LIMIT_COPY, LIMIT_WRITE, TORCH_SAVE, DCP_SAVE, DCP_ASYNC_THREAD, DCP_ASYNC_PROCESS,
             CKPT_OFF, CKPT_THREAD, CKPT_PROCESS, CKPT_BYTES, CKPT_BUFFERED]
    names += [f"ckpt[process,wt={w}]" for w in args.sweep_writer_threads if w != args.writer_threads]
    names.append(CKPT_BUDGET)
    return names


def loop_name(kind: str, threads: Optional[int] = None) -> str:
    """``loop:ckpt[process]`` (the suite's training threads) or ``loop@1t:ckpt[process]`` (1 training thread)."""
    return f"{LOOP_PREFIX}{kind}" if threads is None else f"loop@{threads}t:{kind}"


def parse_loop(name: str) -> Optional[tuple[str, Optional[int]]]:
    """(kind, training threads or None for the suite's) of a loop variant; None for a save variant."""
    m = re.fullmatch(r"loop(?:@(\d+)t)?:(.+)", name)
    return None if m is None else (m.group(2), int(m.group(1)) if m.group(1) else None)


def is_loop(name: str) -> bool:
    return parse_loop(name) is not None


def loop_thread_counts(args: argparse.Namespace, threads: int) -> list[Optional[int]]:
    """The loop's thread settings in a suite: None for the suite's own count, else an explicit other count."""
    out: list[Optional[int]] = []
    for t in args.loop_threads:
        t = None if t in (0, threads) else t
        if t not in out:
            out.append(t)
    return out


def loop_variants(args: argparse.Namespace, ranks: int, threads: int) -> list[str]:
    if args.no_loop or ranks not in args.loop_ranks:
        return []
    return [loop_name(k, t) for t in loop_thread_counts(args, threads) for k in args.loop_kinds]


def performed(name: str) -> tuple[str, ...]:
    """The ``COMPONENTS`` a save variant does: staging copy (async saves), CRC32C and fingerprint (ckpt), write, fsync."""
    if name == LIMIT_COPY:
        return ("copy",)
    if name == LIMIT_WRITE:
        return ("pagecache", "fsync")
    ck = ckpt_spec(name, 0)
    staged = name in (DCP_ASYNC_THREAD, DCP_ASYNC_PROCESS) or bool(ck and ck["mode"] != "off" and not ck["budget"])
    own = ("crc32c", "fingerprint") if ck else ()
    return (("copy",) if staged else ()) + own + ("pagecache", "fsync")


# ------------------------------------------------------------- worker side
class Ctx:
    def __init__(self, rank: int, world: int, spec: dict, model: Any, local: list, local_bytes: int,
                 quiet_tids: tuple = ()) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        self.model, self.local, self.local_bytes = model, local, local_bytes
        self.root = spec["dir"]
        self.quiet_tids = quiet_tids  # the benchmark's own threads (memory sampler): not part of any save

    def cpu_s(self, tree: bool = True) -> float:
        """CPU seconds used so far by this rank's process and (``tree``) its descendants, samplers left out."""
        return C.tree_cpu_s(os.getpid(), self.quiet_tids, tree=tree)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


class Ops:
    """One way to save: ``start(i)`` (what training waits for), ``wait(handle)`` (until durable), ``cleanup(i)``."""

    has_persist = True

    def __init__(self, ctx: Ctx, kind: str, loop: bool = False) -> None:
        self.ctx, self.kind, self.loop = ctx, kind, loop
        self.root = os.path.join(ctx.root, _safe(kind) + ("_loop" if loop else ""))
        if ctx.rank == 0:
            os.makedirs(self.root, exist_ok=True)
        C.barrier()
        self.mgr = None
        self.extra: dict = {}
        ck = ckpt_spec(kind, ctx.spec["writer_threads"])
        if kind in (LIMIT_COPY, LIMIT_WRITE):
            self._setup_limit(kind)
        elif kind == TORCH_SAVE:
            self._setup_torch_save()
        elif kind in (DCP_SAVE, DCP_ASYNC_THREAD, DCP_ASYNC_PROCESS):
            self._setup_dcp(kind)
        elif ck is not None:
            self._setup_ckpt(ck)
        else:
            raise ValueError(f"unknown variant {kind!r}")

    def _setup_limit(self, kind: str) -> None:
        """The limits: a warm ``copy_`` of the state, an fsync'd sequential write of its bytes."""
        import torch

        ctx, rank = self.ctx, self.ctx.rank
        if kind == LIMIT_WRITE:
            self._start = lambda i: C.fsync_write(self._path(i, f"rank{rank}.bin"), ctx.local)
            self._cleanup = lambda i: _unlink(self._path(i, f"rank{rank}.bin"))
            return
        self.has_persist = False
        bufs = [torch.empty_like(t) for t in ctx.local]
        for b in bufs:
            b.fill_(0)  # fault the pages in: the limit is a *warm* copy

        def start(i: int) -> None:
            for b, t in zip(bufs, ctx.local):
                b.copy_(t)

        self._start = start

    def _setup_torch_save(self) -> None:
        """``torch.save`` of the full model state on rank 0, fsync'd (the baseline of the loop's goals)."""
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        ctx, model, rank = self.ctx, self.ctx.model, self.ctx.rank

        def full_state() -> dict:
            if ctx.world == 1:
                return model.state_dict()
            # Lightning's FSDPStrategy default (state_dict_type="full"): gather to rank 0, on CPU.
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        def start(i: int) -> None:
            sd = full_state()
            if rank == 0:
                with open(self._path(i, "model.pt"), "wb") as f:
                    torch.save({"model": sd}, f)
                    f.flush()
                    os.fsync(f.fileno())
            del sd
            C.barrier()

        self._start = start
        if rank == 0 and not self.loop:
            self._cleanup = lambda i: _unlink(self._path(i, "model.pt"))

    def _setup_dcp(self, kind: str) -> None:
        """Stock DCP: ``dcp.save``, ``dcp.async_save`` in a thread or a process."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        model = self.ctx.model
        self._cleanup = self._rm_dir
        if kind == DCP_SAVE:
            self._start = lambda i: dcp.save({"model": model.state_dict()},
                                             storage_writer=FileSystemWriter(self._dir(i)))
            return
        ctype = AsyncCheckpointerType.PROCESS if kind == DCP_ASYNC_PROCESS else AsyncCheckpointerType.THREAD
        self._start = lambda i: dcp.async_save({"model": model.state_dict()},
                                               storage_writer=FileSystemWriter(self._dir(i)),
                                               async_checkpointer_type=ctype)
        self._wait = lambda h: h.result()

    def _setup_ckpt(self, ck: dict) -> None:
        """This library's ``CheckpointManager.save`` in the mode, writer threads and budget ``ck`` names."""
        from ckpt_core import CheckpointManager, TrainState

        ctx, rank = self.ctx, self.ctx.rank
        budget = max(1, ctx.local_bytes // 2) if ck["budget"] else None
        self.extra["max_host_memory_bytes"] = budget
        nice = {} if ck["nice"] is None else {"writer_nice": ck["nice"]}
        self.mgr = CheckpointManager(self.root, async_mode=ck["mode"], writer_threads=ck["wt"],
                                     max_host_memory_bytes=budget, keep_last=1 if self.loop else None,
                                     resume=False, direct_io=ck["direct"], **nice)
        state = TrainState(model=ctx.model)
        self._start = lambda i: self.mgr.save(i + 1, state)
        self._wait = lambda h: self.mgr.wait()
        if not self.loop:
            from ckpt_core.storage import step_dirname

            self._cleanup = lambda i: (C.rmtree(os.path.join(self.root, step_dirname(i + 1)))
                                       if rank == 0 else None)

    # plumbing ---------------------------------------------------------------
    def _dir(self, i: int) -> str:
        return os.path.join(self.root, "latest" if self.loop else f"save_{i:04d}")

    def _path(self, i: int, name: str) -> str:
        return os.path.join(self.root, name if self.loop else f"{i:04d}_{name}")

    def _rm_dir(self, i: int) -> None:
        if self.ctx.rank == 0 and not self.loop:
            C.rmtree(self._dir(i))

    def _start(self, i: int) -> Any:  # replaced per kind
        raise NotImplementedError

    def _wait(self, handle: Any) -> None:
        return None

    def _cleanup(self, i: int) -> None:
        return None

    def start(self, i: int) -> Any:
        return self._start(i)

    def tick(self) -> None:
        """Once per training step, as ``maybe_save`` does: collect a finished save, start retention."""
        if self.mgr is not None:
            self.mgr.poll()

    def wait(self, handle: Any) -> None:
        self._wait(handle)

    def cleanup(self, i: int) -> None:
        self._cleanup(i)
        C.barrier()

    def close(self) -> None:
        if self.mgr is not None:
            self.extra["manager_blocking_s"] = [s.blocking_s for s in self.mgr.save_history]
            self.extra["manager_write_s"] = [s.write_s for s in self.mgr.save_history]
            self.mgr.close()
        C.barrier()
        if self.ctx.rank == 0:
            C.rmtree(self.root)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def measure(ops: Ops, i: int) -> dict:
    """One save: stall and persist time; CPU of the rank's whole process tree and of this thread in the call."""
    C.barrier()
    cpu0 = ops.ctx.cpu_s()
    t0, c0 = time.perf_counter(), time.thread_time()
    handle = ops.start(i)
    t1, c1 = time.perf_counter(), time.thread_time()
    ops.wait(handle)
    t2 = time.perf_counter()
    cpu = ops.ctx.cpu_s() - cpu0
    C.barrier()
    ops.cleanup(i)
    return {"stall": t1 - t0, "persist": (t2 - t0) if ops.has_persist else None, "cpu_s": cpu, "call_cpu_s": c1 - c0}


def run_save_variant(ctx: Ctx, name: str) -> dict:
    ops = Ops(ctx, name)
    try:
        first = measure(ops, 0)
        steady = [measure(ops, i) for i in range(1, 1 + ctx.spec["saves"])]
    finally:
        ops.close()
    return {"first": first, "steady": steady, "extra": ops.extra}


def measure_refs(ctx: Ctx) -> dict:
    """The machine's limits again, in this process right after a variant: paired references for its ratios.

    The shared machine drifts by several times within minutes, so a variant's
    stall is divided by a warm ``copy_`` of the same bytes timed in the same
    process seconds later (median of 3), its persist time compared with an
    fsync'd sequential write timed right after it, and its CPU with the CPU of
    the pieces of a write over the same bytes (``COMPONENTS``), each timed on
    its own: the staging copy (CPU of this process), and, as thread CPU time,
    the write syscalls into the page cache, the fsyncs, CRC32C
    (``crc32c.crc32c``) and the fingerprint (``fingerprint.tensor_entry``).
    """
    out = _time_copies(ctx)
    path = os.path.join(ctx.root, f"ref_rank{ctx.rank}.bin")
    writes = []
    for _ in range(2):  # the first fsync'd write of a process runs slower here: time the second, as 'steady'
        C.barrier()
        writes.append(C.timed_write(path, ctx.local))
        _unlink(path)
    w = writes[-1]
    out.update(write_s=w["total_s"], pagecache_s=w["write_s"], fsync_s=w["fsync_s"],
               pagecache_cpu_s=w["write_cpu_s"], fsync_cpu_s=w["fsync_cpu_s"])
    out.update(_time_passes(ctx))
    C.barrier()
    return out


def _time_copies(ctx: Ctx) -> dict:
    """Warm ``copy_`` of the rank's tensors into preallocated buffers: median wall and process CPU of 3."""
    import torch

    bufs = [torch.empty_like(t) for t in ctx.local]
    for b in bufs:
        b.fill_(0)
    walls, cpus = [], []
    for _ in range(3):
        C.barrier()
        t0, c0 = time.perf_counter(), ctx.cpu_s(tree=False)  # copy_ runs on torch's intra-op threads too
        for b, t in zip(bufs, ctx.local):
            b.copy_(t)
        walls.append(time.perf_counter() - t0)
        cpus.append(ctx.cpu_s(tree=False) - c0)
    del bufs
    return {"copy_s": C.median(walls), "copy_cpu_s": C.median(cpus)}


def _time_passes(ctx: Ctx) -> dict:
    """Thread CPU time of a CRC32C and of a fingerprint pass over the rank's tensors."""
    import crc32c

    from ckpt_core.fingerprint import tensor_entry

    c0 = time.thread_time()
    for t in ctx.local:
        crc32c.crc32c(memoryview(t.numpy()).cast("B"))
    c1 = time.thread_time()
    for t in ctx.local:
        tensor_entry(t)
    c2 = time.thread_time()
    return {"crc32c_cpu_s": c1 - c0, "fingerprint_cpu_s": c2 - c1}


def make_work(ctx: Ctx, threads: int):
    """One toy training step: ``k`` matmuls (calibrated by the harness for ``threads``) and, on several ranks, an all_reduce."""
    import torch
    import torch.distributed as dist

    cal = ctx.spec["loop"]["cal"][str(threads)]
    n, k = cal["matmul_n"], cal["matmuls_per_step"]
    g = torch.Generator().manual_seed(ctx.rank)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    grad = torch.zeros(1024)

    def step() -> None:
        for _ in range(k):
            torch.mm(a, b, out=c)
        if ctx.world > 1:
            dist.all_reduce(grad)

    return step


def run_loop_variant(ctx: Ctx, name: str, rnd: int = 0) -> dict:
    """Training overhead of saving every ``every`` steps, measured in pairs of periods in one process.

    A *ckpt* period is: save (the stall), ``every`` steps, then wait until that
    save is durable (a write longer than the period is overhead in steady state
    too). A *base* period is the same ``every`` steps without a save. Periods
    alternate, and which comes first alternates from pair to pair and from
    round to round (``rnd``), so the shared machine's drift hits both alike;
    overhead = sum(ckpt periods) / sum(base periods) - 1. The loop trains on
    the variant's thread count (``loop@1t:...``: 1), the suite's otherwise.
    """
    import torch

    kind, threads = parse_loop(name)
    threads = threads or ctx.spec["threads"]
    ops = Ops(ctx, kind, loop=True)
    torch.set_num_threads(threads)
    try:
        step = make_work(ctx, threads)
        ops.wait(ops.start(0))  # the first save (spawn, plan, buffers) is not part of the steady state
        step()
        out = _loop_periods(ops, step, ctx.spec["loop"], rnd)
    finally:
        torch.set_num_threads(ctx.spec["threads"])
        ops.close()
    return {**out, "threads": threads, "extra": ops.extra}


def _loop_periods(ops: Ops, step: Any, lp: dict, rnd: int) -> dict:
    """Alternating base and ckpt periods of ``lp['every']`` steps, ``lp['pairs']`` of each."""
    base_s, ckpt_s, stalls, drains = [], [], [], []
    n = 0
    for p in range(lp["pairs"]):
        for what in (("base", "ckpt") if (p + rnd) % 2 == 0 else ("ckpt", "base")):
            C.barrier()
            t0 = time.perf_counter()
            if what == "ckpt":
                n += 1
                handle = ops.start(n)
                stalls.append(time.perf_counter() - t0)
            for _ in range(lp["every"]):
                step()
                ops.tick()
            if what == "ckpt":
                td = time.perf_counter()
                ops.wait(handle)
                drains.append(time.perf_counter() - td)
            (ckpt_s if what == "ckpt" else base_s).append(time.perf_counter() - t0)
    return {"base_s": base_s, "ckpt_s": ckpt_s, "stalls": stalls, "drains": drains}


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    import resource

    import torch
    import torch.distributed as dist

    C.init_dist(rank, world, port)
    torch.set_num_threads(spec["threads"])
    import torch.distributed.checkpoint  # noqa: F401 - import before the memory baseline
    import ckpt_core  # noqa: F401

    sampler = C.MemSampler(spec["mem_interval_s"]).start()
    base_mem, base_rss = sampler.current()
    model, local, local_bytes = C.build_model(spec["size_bytes"], spec["tensor_bytes"], rank, world)
    ctx = Ctx(rank, world, spec, model, local, local_bytes, quiet_tids=(sampler.native_id,))
    rounds = []
    for j, order in enumerate(spec["rounds"]):
        rounds.append(_run_round(ctx, sampler, order, base_mem, base_rss, spec.get("first_round", 0) + j))
    sampler.stop()
    C.stop_dcp_process()
    proc = {"maxrss_self": C.maxrss_bytes(resource.RUSAGE_SELF),
            "maxrss_children": C.maxrss_bytes(resource.RUSAGE_CHILDREN), "local_bytes": local_bytes}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "rounds": rounds, "proc": proc})
    if rank == 0:
        C.write_result(spec, gathered)
    dist.barrier()
    C.finish_rank(world)


def _run_round(ctx: Ctx, sampler: Any, order: list, base_mem: int, base_rss: int, rnd: int) -> dict:
    spec, rank = ctx.spec, ctx.rank
    out: dict = {}
    for name in order:
        C.barrier()
        sampler.window()
        t0 = time.perf_counter()
        try:
            res = run_loop_variant(ctx, name, rnd) if is_loop(name) else run_save_variant(ctx, name)
        except Exception:  # noqa: BLE001 - a failing variant is reported, the others still run
            res = {"error": C.format_exc()}
            print(f"[rank {rank}] {name} failed:\n{res['error']}", flush=True)
        time.sleep(3 * spec["mem_interval_s"])
        res["mem"] = {"peak": sampler.peak, "peak_rss": sampler.peak_rss, "base": base_mem,
                      "base_rss": base_rss, "samples": sampler.samples}
        if "error" not in res and not is_loop(name) and name not in (LIMIT_COPY, LIMIT_WRITE):
            res["ref"] = measure_refs(ctx)  # after the memory window: its buffers are not the variant's
        res["wall_s"] = time.perf_counter() - t0
        if rank == 0:
            print(f"[worker] {name}: {res['wall_s']:.1f}s", flush=True)
        out[name] = res
    return out


def worker_main(spec_path: str) -> None:
    C.worker(spec_path, rank_main)


# -------------------------------------------------------------- harness side
def calibrate(threads: int, n: int, step_s: float) -> dict:
    """Matmuls per toy training step so that one step takes about ``step_s`` on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b, out=c)
        times.append((time.perf_counter() - t0) / 10)
    per = min(times)  # the uncontended speed: the machine is shared, noise only ever slows it down
    return {"matmul_n": n, "matmul_s": per, "matmuls_per_step": max(1, round(step_s / per)), "threads": threads}


REF_WALL = ("copy_s", "write_s", "pagecache_s", "fsync_s")
"""Wall-time references: over ranks, the slowest rank's. The ``*_cpu_s`` ones add up over ranks."""


def merge_ranks(gathered: list, name: str, rnd: int = 0, round_index: Optional[int] = None) -> dict:
    """One variant's result over ranks: per save the slowest rank's times and all ranks' CPU; memory per rank.

    ``rnd`` indexes the rounds of this worker; ``round_index`` is the round of
    the whole run (default ``rnd``), which pairs variants round by round.
    """
    per_rank = [g["rounds"][rnd][name] for g in gathered]
    errors = [r["error"] for r in per_rank if "error" in r]
    mem = []
    for g, r in zip(gathered, per_rank):
        m, lb = r["mem"], g["proc"]["local_bytes"]
        mem.append({"rank": g["rank"], "local_bytes": lb, "net": (m["peak"] - m["base"]) / lb,
                    "gross": m["peak"] / lb, "peak": m["peak"], "base": m["base"],
                    "peak_rss_sum": m["peak_rss"], "maxrss_self": g["proc"]["maxrss_self"],
                    "maxrss_children": g["proc"]["maxrss_children"], "samples": m["samples"]})
    out: dict = {"mem": mem, "mem_net": max(x["net"] for x in mem), "mem_gross": max(x["gross"] for x in mem),
                 "round": rnd if round_index is None else round_index}
    if errors:
        out["error"] = errors[0]
        return out
    out["extra"] = per_rank[0]["extra"]
    if is_loop(name):
        for k in ("base_s", "ckpt_s", "stalls", "drains"):
            out[k] = [max(v) for v in zip(*[r[k] for r in per_rank])]
        out["threads"] = per_rank[0].get("threads")
        out["overhead"] = sum(out["ckpt_s"]) / sum(out["base_s"]) - 1
        out["pair_overheads"] = [c / b - 1 for b, c in zip(out["base_s"], out["ckpt_s"])]
        return out
    if all("ref" in r for r in per_rank):
        out["ref"] = {k: (max if k in REF_WALL else sum)(r["ref"][k] for r in per_rank) for k in per_rank[0]["ref"]}
    out["first"] = _merge_save([r["first"] for r in per_rank])
    out["steady"] = [_merge_save(list(items)) for items in zip(*[r["steady"] for r in per_rank])]
    return out


def _merge_save(items: list) -> dict:
    """One save over ranks: the slowest rank's stall and persist time, the CPU of all ranks together."""

    def over(key: str, how: Any) -> Optional[float]:
        vals = [it.get(key) for it in items]
        return None if any(v is None for v in vals) else how(vals)

    return {"stall": over("stall", max), "persist": over("persist", max), "cpu_s": over("cpu_s", sum),
            "call_cpu_s": over("call_cpu_s", sum)}


def round_orders(names: list, args: argparse.Namespace) -> list[list[str]]:
    """Variant order per round, rotated by one each round: save variants in the first ``repeats`` rounds,
    loop variants in the first ``loop_repeats``."""
    def rounds_of(name: str) -> int:
        return args.loop_repeats if is_loop(name) else args.repeats

    n = max((rounds_of(x) for x in names), default=0)
    orders = []
    for k in range(n):
        rot = names[k % len(names):] + names[:k % len(names)]
        orders.append([x for x in rot if k < rounds_of(x)])
    return orders


def suite_plan(args: argparse.Namespace, ranks: int) -> dict:
    """Threads, loop calibrations (one per training-thread count), variants and worker spec of one suite."""
    cpus = os.cpu_count() or 1
    threads = args.train_threads or max(1, cpus // ranks)
    loops = loop_variants(args, ranks, threads)
    counts = sorted({threads} | {parse_loop(n)[1] or threads for n in loops})
    cals = {str(t): calibrate(t, args.matmul_n, args.loop_step_s) for t in counts}
    cal = cals[str(threads)]
    loop = {**cal, "every": args.loop_every, "pairs": args.loop_pairs, "step_s_target": args.loop_step_s, "cal": cals}
    names = save_variants(args) + loops
    if args.variants:
        wanted = set(re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args.variants))  # commas inside [...] stay
        names = [n for n in names if n in wanted or n.split("[")[0] in wanted]
    spec = {
        "ranks": ranks, "threads": threads, "size_bytes": args.size_bytes, "tensor_bytes": args.tensor_bytes,
        "saves": args.saves, "writer_threads": args.writer_threads, "loop": loop,
        "mem_interval_s": args.mem_interval,
    }
    return {"cpus": cpus, "threads": threads, "cal": cal, "loop": loop, "names": names, "spec": spec}


def run_suite(args: argparse.Namespace, ranks: int, log_path: Path) -> dict:
    plan = suite_plan(args, ranks)
    threads, cal, names = plan["threads"], plan["cal"], plan["names"]
    timeout = 300 + 120 * args.size_bytes / C.GiB * (1 + args.saves) + 6 * args.loop_step_s * args.loop_every * args.loop_pairs
    samples: dict[str, list] = {n: [] for n in names}
    failures: list[str] = []
    job = 0

    def run(rounds: list[list[str]], label: str, first_round: int = 0) -> Optional[list]:
        nonlocal job
        job += 1
        d = os.path.join(args.dir, f"r{ranks}_job{job:03d}")
        os.makedirs(d, exist_ok=True)
        n = sum(len(r) for r in rounds)
        try:
            return C.run_worker("save", {**plan["spec"], "rounds": rounds, "dir": d, "label": label,
                                         "first_round": first_round},
                                timeout=timeout * max(1, n // 3), log_path=log_path)
        except RuntimeError as e:
            failures.append(f"{label}: {e}")
            print(f"  ! {label} failed: {str(e).splitlines()[0]}", flush=True)
            return None
        finally:
            C.rmtree(d)

    orders = round_orders(names, args)
    print(f"\n== {ranks} rank(s): state {args.size_bytes / C.GiB:.3g} GiB in {len(C.layout(args.size_bytes, args.tensor_bytes))} "
          f"tensors, {threads} thread(s)/rank, {args.repeats} rounds of saves, {args.loop_repeats} of the loop, "
          f"isolation={args.isolation}; toy step " + ", ".join(
              f"{c['matmuls_per_step']} x {c['matmul_n']}^2 matmuls ~ {c['matmuls_per_step'] * c['matmul_s']:.2f}s "
              f"on {t} thread(s)" for t, c in plan["loop"]["cal"].items())
          + f", save every {args.loop_every} steps", flush=True)
    if not args.quick:
        # Warm-up: one throwaway worker (file cache of the interpreter and torch, first-run costs of the
        # disk). Every worker also does one untimed-for-steady-state first save per variant.
        run([[LIMIT_COPY, LIMIT_WRITE]], "warm-up")
    _run_rounds(args, orders, run, samples)
    return {"ranks": ranks, "threads_per_rank": threads, "cpus": plan["cpus"], "calibration": cal,
            "loop": plan["loop"], "isolation": args.isolation, "variants": names, "samples": samples,
            "failures": failures, "summary": summarize(samples, names, args, ranks, threads, plan["cpus"])}


def _run_rounds(args: argparse.Namespace, orders: list, run: Any, samples: dict) -> None:
    """Run the rounds in workers as ``--isolation`` says; add each variant's merged result to ``samples``."""
    if args.isolation == "run":  # one process for every round (--quick): fastest, least isolated
        t0 = time.time()
        g = run(orders, "all rounds")
        if g is not None:
            for rnd, order in enumerate(orders):
                for name in order:
                    samples[name].append(merge_ranks(g, name, rnd))
        print(f"  {len(orders)} rounds done in {time.time() - t0:.0f}s", flush=True)
        return
    for rnd, order in enumerate(orders):
        t0 = time.time()
        if args.isolation == "variant":
            for name in order:
                g = run([[name]], f"round {rnd} {name}", rnd)
                if g is not None:
                    samples[name].append(merge_ranks(g, name, 0, rnd))
        else:
            g = run([order], f"round {rnd}", rnd)
            if g is not None:
                for name in order:
                    samples[name].append(merge_ranks(g, name, 0, rnd))
        print(f"  round {rnd + 1}/{len(orders)} done in {time.time() - t0:.0f}s", flush=True)


# ------------------------------------------------------------------ summary
def estimate(rows: list, stat: Callable[[Any], float]) -> dict:
    """``stat`` over all rows (one per round) and its 95 % bootstrap CI over the rounds; rows with a None are left out."""
    import numpy as np

    rows = [tuple(r) for r in rows if all(x is not None for x in r)]
    if not rows:
        return {"value": None, "ci": None, "n": 0}
    with np.errstate(all="ignore"):
        value = float(stat(np.asarray(rows, dtype=float)))
    ci = C.bootstrap_ci(rows, stat)
    return {"value": None if math.isnan(value) else value, "ci": list(ci) if ci else None, "n": len(rows)}


def mean0(a: Any) -> float:
    """Mean of column 0 over the rounds."""
    return float(a[:, 0].mean())


def overhead_stat(a: Any) -> float:
    """Training overhead over the rounds: sum of ckpt periods (column 0) / sum of base periods (column 1) - 1."""
    return C.ratio_of_sums(a) - 1


def overhead_ratio_stat(a: Any) -> float:
    """A variant's overhead (columns 0, 1) over torch.save's (columns 2, 3), both as in ``overhead_stat``.

    Where torch.save shows no overhead (<= 0), the ratio is infinite if the
    variant shows some, undefined (NaN) if neither does.
    """
    own, ref = overhead_stat(a[:, 0:2]), overhead_stat(a[:, 2:4])
    if ref > 0:
        return own / ref
    return math.inf if own > 0 else math.nan


def floor_cpu(ref: dict) -> float:
    """The floor of a write's CPU: the copy into the page cache plus a hardware CRC32C of the same bytes."""
    return ref["pagecache_cpu_s"] + ref["crc32c_cpu_s"]


def suite_components(samples: dict, gib: float) -> dict:
    """CPU of each write component and of the floor in s/GiB: medians over every reference of the suite."""
    refs = [s["ref"] for ss in samples.values() for s in ss if "ref" in s]
    out = {c: C.median([r[f"{c}_cpu_s"] / gib for r in refs]) for c in COMPONENTS}
    out["floor"] = C.median([floor_cpu(r) / gib for r in refs])
    return out


def summarize(samples: dict, names: list, args: argparse.Namespace, ranks: int, threads: int = 1,
              cpus: int = 1) -> dict:
    total = args.size_bytes
    comps = suite_components(samples, total / C.GiB)
    rows: dict[str, dict] = {}
    for name in names:
        good = [s for s in samples.get(name, []) if "error" not in s]
        rows[name] = _loop_row(good) if is_loop(name) else _save_row(name, good, total, comps)
    copy_s = rows.get(LIMIT_COPY, {}).get("stall_s")
    write_s = rows.get(LIMIT_WRITE, {}).get("persist_s")
    tsave_s = rows.get(TORCH_SAVE, {}).get("stall_s")
    for name, r in rows.items():
        if is_loop(name):
            _vs_torch_save(name, r, rows)
            continue
        r["stall_over_copy_unpaired"] = C.ratio(r["stall_s"], copy_s)
        r["persist_over_limit_unpaired"] = C.ratio(write_s, r["persist_s"])
        r["stall_over_copy"] = r["stall_over_copy_paired"] or r["stall_over_copy_unpaired"]
        r["persist_over_limit"] = r["persist_over_limit_paired"] or r["persist_over_limit_unpaired"]
        r["stall_over_torch_save"] = C.ratio(r["stall_s"], tsave_s)
        r["persist_GBps"] = C.ratio(total / 1e9, r["persist_s"])
        loop = rows.get(LOOP_PREFIX + name)
        r["loop_overhead"] = loop.get("overhead") if loop else None
    return {"rows": rows, "targets": targets(rows, args), "goals": goals(rows, ranks, threads, cpus),
            "components_s_per_gib": comps, "state_bytes": total, "ranks": ranks}


def _loop_row(good: list) -> dict:
    """A loop variant: overhead over the rounds (with CI), medians of its periods."""
    per_round = [[s["round"], sum(s["ckpt_s"]), sum(s["base_s"])] for s in good]
    est = estimate([(c, b) for _, c, b in per_round], overhead_stat)
    return {"overhead": est["value"], "overhead_ci": est["ci"], "per_round": per_round,
            "overhead_per_round": [s["overhead"] for s in good],
            "overhead_median_pair": C.median([x for s in good for x in s["pair_overheads"]]),
            "threads": good[0].get("threads") if good else None,
            "base_period_s": C.median([x for s in good for x in s["base_s"]]),
            "ckpt_period_s": C.median([x for s in good for x in s["ckpt_s"]]),
            "loop_stall_s": C.median([x for s in good for x in s["stalls"]]),
            "drain_s": C.median([x for s in good for x in s["drains"]]),
            "mem_net": C.median([s["mem_net"] for s in good]), "n": len(good)}


def _vs_torch_save(name: str, r: dict, rows: dict) -> None:
    """A loop variant's overhead over torch.save's at the same thread setting, paired round by round."""
    kind, t = parse_loop(name)
    ts = rows.get(loop_name(TORCH_SAVE, t))
    if kind == TORCH_SAVE or not ts:
        r["over_torch_save"], r["over_torch_save_ci"] = None, None
        return
    theirs = {rnd: (c, b) for rnd, c, b in ts["per_round"]}
    est = estimate([(c, b, *theirs[rnd]) for rnd, c, b in r["per_round"] if rnd in theirs], overhead_ratio_stat)
    r["over_torch_save"], r["over_torch_save_ci"] = est["value"], est["ci"]


def _save_row(name: str, good: list, total: int, comps: dict) -> dict:
    """A save variant: medians of its times and memory; paired ratios with CIs; CPU per GiB and its breakdown."""
    gib = total / C.GiB
    per = [{"stall": C.median([x["stall"] for x in s["steady"]]), "persist": C.median([x["persist"] for x in s["steady"]]),
            "cpu": C.median([x.get("cpu_s") for x in s["steady"]]), "ref": s.get("ref"),
            "call": C.median([x.get("call_cpu_s") for x in s["steady"]])} for s in good]
    paired = [p for p in per if p["ref"]]
    stall = estimate([(p["stall"], p["ref"]["copy_s"]) for p in paired], C.ratio_of_sums)
    persist = estimate([(p["ref"]["write_s"], p["persist"]) for p in paired if p["persist"]], C.ratio_of_sums)
    cpu = estimate([(p["cpu"] / gib,) for p in per if p["cpu"] is not None], mean0)
    floor = estimate([(p["cpu"], floor_cpu(p["ref"])) for p in paired], C.ratio_of_sums)
    mem = estimate([(s["mem_net"],) for s in good], mean0)
    own = {c: C.median([p["ref"][f"{c}_cpu_s"] / gib for p in paired]) for c in COMPONENTS} if paired else comps
    parts = [own[c] for c in performed(name)]
    return {
        "first_stall_s": C.median([s["first"]["stall"] for s in good]),
        "first_persist_s": C.median([s["first"]["persist"] for s in good]),
        "stall_s": C.median([p["stall"] for p in per]), "persist_s": C.median([p["persist"] for p in per]),
        "mem_net": C.median([s["mem_net"] for s in good]), "mem_net_mean": mem["value"], "mem_net_ci": mem["ci"],
        "mem_gross": C.median([s["mem_gross"] for s in good]), "n": len(good),
        # paired with the references measured in the same process (see measure_refs); ratio of totals over rounds
        "stall_over_copy_paired": stall["value"], "stall_over_copy_ci": stall["ci"],
        "persist_over_limit_paired": persist["value"], "persist_over_limit_ci": persist["ci"],
        "cpu_s_per_gib": cpu["value"], "cpu_s_per_gib_ci": cpu["ci"],
        "call_cpu_s_per_gib": C.median([p["call"] / gib for p in per if p["call"] is not None]),
        "cpu_over_floor": floor["value"] if paired else C.ratio(cpu["value"], comps.get("floor")),
        "cpu_over_floor_ci": floor["ci"],
        "components_s_per_gib": {c: own[c] for c in performed(name)},
        "rest_s_per_gib": (cpu["value"] - sum(parts)) if cpu["value"] is not None and None not in parts else None,
    }


def goals(rows: dict, ranks: int, threads: int, cpus: int) -> list[dict]:
    """The goals of issue 18 for the background-process modes (ckpt[process], ckpt[bytes]): each figure with
    its 95 % CI and whether the whole CI meets the goal."""
    out: list[dict] = []

    def add(goal: str, variant: str, value: Optional[float], ci: Optional[list], limit: float, unit: str,
            higher_is_better: bool = False) -> None:
        status = C.goal_status(ci, limit, higher_is_better)
        out.append({"goal": goal, "variant": variant, "value": value, "ci": ci, "limit": limit, "unit": unit,
                    "status": status, "ci_meets_goal": status == "PASS"})

    for v in (CKPT_PROCESS, CKPT_BYTES):
        _variant_goals(rows, v, ranks, threads, cpus, add)
    return out


def _variant_goals(rows: dict, v: str, ranks: int, threads: int, cpus: int, add: Callable[..., None]) -> None:
    p = rows.get(v)
    if p:
        add("CPU of the background write <= 0.5 s/GiB", v, p["cpu_s_per_gib"], p["cpu_s_per_gib_ci"], 0.5, "s/GiB")
    for name, r in rows.items():
        kind, t = parse_loop(name) or (None, None)
        if kind != v:
            continue
        t = t or threads
        idle = t * ranks < cpus
        setting = (f"{t} train thread" + ("s" if t > 1 else "")) if idle else "every core busy"
        add(f"training overhead <= 0.5x torch.save+fsync's ({setting})", name, r.get("over_torch_save"),
            r.get("over_torch_save_ci"), 0.5, "x")
        if t == 1 and idle:
            add("training overhead <= 5% (1 train thread)", name, r["overhead"], r["overhead_ci"], 0.05, "%")
    if ranks == 2 and p:
        add("persist >= 0.8x fsync'd write of the same bytes (2 ranks)", v,
            p["persist_over_limit_paired"], p["persist_over_limit_ci"], 0.8, "x", higher_is_better=True)
        add("peak host memory <= 2.2x state (2 ranks)", v, p["mem_net_mean"], p["mem_net_ci"], 2.2, "x")


def targets(rows: dict, args: argparse.Namespace) -> list[dict]:
    out = []

    def add(what: str, variant: str, value: Optional[float], limit: float, text: str, higher_is_better=False):
        status = "n/a" if value is None else (
            "PASS" if (value >= limit if higher_is_better else value <= limit) else "MISS")
        out.append({"target": what, "variant": variant, "value": value, "limit": limit, "status": status,
                    "text": text})

    for v, stock in ((CKPT_PROCESS, DCP_ASYNC_PROCESS), (CKPT_BYTES, DCP_ASYNC_PROCESS),
                     (CKPT_THREAD, DCP_ASYNC_THREAD)):
        r = rows.get(v)
        if not r:
            continue
        add("steady-state stall <= 1.3x warm copy_", v, r.get("stall_over_copy"), 1.3,
            f"{C.fmt(r.get('stall_s'))}s = {C.fmt(r.get('stall_over_copy'), '.2f')}x copy")
        st = rows.get(stock, {}).get("stall_s")
        add(f"stall <= stock {stock}", v, C.ratio(r.get("stall_s"), st), 1.0,
            f"{C.fmt(r.get('stall_s'))}s vs {C.fmt(st)}s")
        add("stall <= 0.1x torch.save+fsync", v, r.get("stall_over_torch_save"), 0.1,
            f"{C.fmt(r.get('stall_over_torch_save'), '.3f')}x")
        add("persist throughput >= 0.8x fsync'd write", v, r.get("persist_over_limit"), 0.8,
            f"{C.fmt(r.get('persist_GBps'), '.2f')} GB/s = {C.fmt(r.get('persist_over_limit'), '.2f')}x limit",
            higher_is_better=True)
        ovh = r.get("loop_overhead")
        if LOOP_PREFIX + v in rows:  # the loop ran this variant (--loop-kinds)
            add(f"training overhead <= 5% (save every ~{args.loop_every * args.loop_step_s:.3g}s)", v, ovh, 0.05,
                f"{C.fmt(None if ovh is None else 100 * ovh, '+.1f')}%")
        add("peak host memory <= 2.2x state", v, r.get("mem_net"), 2.2,
            f"{C.fmt(r.get('mem_net'), '.2f')}x (gross incl. runtime {C.fmt(r.get('mem_gross'), '.2f')}x)")
    sweep = [(n, r) for n, r in rows.items() if n.startswith("ckpt[process") and "budget" not in n
             and r.get("persist_over_limit") is not None]
    if len(sweep) > 1:
        best = max(sweep, key=lambda nr: nr[1]["persist_over_limit"])
        add("persist throughput >= 0.8x fsync'd write (best writer_threads)", best[0],
            best[1]["persist_over_limit"], 0.8, f"{best[1]['persist_over_limit']:.2f}x limit",
            higher_is_better=True)
    b = rows.get(CKPT_BUDGET)
    if b and b.get("mem_net") is not None:
        extra = b["mem_net"] - 1.0  # over the live state, in units of the state
        add("budget: extra host memory <= max_host_memory_bytes (state/2)", CKPT_BUDGET, extra, 0.5,
            f"extra {extra:.2f}x state, bound 0.50x")
    return out


def fmt_ci(ci: Optional[list], spec: str = ".2f", scale: float = 1.0) -> str:
    """``[lo, hi]`` of a confidence interval, or ``-``."""
    return "-" if not ci else f"[{scale * ci[0]:{spec}}, {scale * ci[1]:{spec}}]"


def print_table(suite: dict) -> None:
    s = suite["summary"]
    rows = s["rows"]
    hdr = (f"{'variant':<26}{'first':>8}{'stall':>8}{'/copy':>8}{'/t.save':>9}{'persist':>9}{'GB/s':>7}"
           f"{'/limit':>8}{'train+%':>9}{'mem/state':>10}{'n':>3}")
    print(f"\n-- {suite['ranks']} rank(s), state {s['state_bytes'] / C.GiB:.3g} GiB, "
          f"{suite['threads_per_rank']} torch thread(s)/rank (medians; seconds; first = first save of a fresh process; "
          f"/copy and /limit: totals over the rounds, each round paired with a copy_ and a write timed in the same "
          f"process) --")
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows.items():
        if is_loop(name):
            continue
        ovh = r.get("loop_overhead")
        print(f"{name:<26}{C.fmt(r['first_stall_s'], '.3f'):>8}{C.fmt(r['stall_s'], '.3f'):>8}"
              f"{C.fmt(r['stall_over_copy'], '.2f'):>8}{C.fmt(r['stall_over_torch_save'], '.3f'):>9}"
              f"{C.fmt(r['persist_s'], '.2f'):>9}{C.fmt(r['persist_GBps'], '.2f'):>7}"
              f"{C.fmt(r['persist_over_limit'], '.2f'):>8}{C.fmt(None if ovh is None else 100 * ovh, '+.1f'):>9}"
              f"{C.fmt(r['mem_net'], '.2f'):>10}{r['n']:>3}")
    print_cpu(s)
    print_cis(rows)
    print_loops(suite)
    print("\ntargets (issue 3; reported, not asserted):")
    for t in s["targets"]:
        print(f"  [{t['status']:>4}] {t['target']:<62} {t['variant']:<26} {t['text']}")
    print_goals(s.get("goals", []))
    if suite.get("isolation", "variant") != "variant":
        print(f"note: isolation={suite['isolation']}: variants share a process, so 'first' and 'mem/state' are "
              "not per-variant figures (use the default --isolation variant for those)")
    if suite["failures"]:
        print(f"\n{len(suite['failures'])} worker failure(s):")
        for f in suite["failures"]:
            print("  " + f.splitlines()[0])


def print_cpu(summary: dict) -> None:
    """CPU per GiB of every save variant, next to the CPU of the write's components and the floor."""
    comps = summary.get("components_s_per_gib", {})
    names = {"copy": "copy_", "crc32c": "crc32c", "fingerprint": "fprint", "pagecache": "write", "fsync": "fsync"}
    hdr = (f"{'variant':<26}{'cpu/GiB':>8}{'in call':>8}{'/floor':>8}"
           + "".join(f"{names[c]:>8}" for c in COMPONENTS) + f"{'rest':>8}")
    print("\nCPU per GiB written, s/GiB (medians over the rounds). cpu: every process and thread of each rank from "
          "the save call until durable;\nin call: the training thread inside the save call; /floor: cpu over the "
          "floor, paired by round; components: timed on their own\nover the same bytes in the same process ('-': "
          "not done by the variant); rest = cpu - components (serialization, planning, IPC):")
    print(hdr)
    print("-" * len(hdr))
    for name, r in summary["rows"].items():
        if is_loop(name):
            continue
        own = r.get("components_s_per_gib", {})
        print(f"{name:<26}{C.fmt(r.get('cpu_s_per_gib'), '.3f'):>8}{C.fmt(r.get('call_cpu_s_per_gib'), '.3f'):>8}"
              f"{C.fmt(r.get('cpu_over_floor'), '.2f'):>8}"
              + "".join(f"{C.fmt(own.get(c), '.3f'):>8}" for c in COMPONENTS)
              + f"{C.fmt(r.get('rest_s_per_gib'), '.3f'):>8}")
    hw = _crc32c_hardware()
    print(f"components (medians over the suite, s/GiB): "
          + ", ".join(f"{names[c]} {C.fmt(comps.get(c), '.3f')}" for c in COMPONENTS)
          + f"; floor = write + crc32c = {C.fmt(comps.get('floor'), '.3f')} (crc32c "
          + ("hardware" if hw else "software" if hw is False else "?") + "; writeback by kernel threads is not counted)")


def _crc32c_hardware() -> Optional[bool]:
    try:
        import crc32c

        return bool(getattr(crc32c, "hardware_based", None))
    except ImportError:
        return None


def print_cis(rows: dict) -> None:
    """Every paired ratio of the save variants with its 95 % bootstrap CI over the rounds."""
    print("\nratios with 95% CIs (bootstrap over the rounds, 2000 resamples; ratio of totals, paired by round):")
    print(f"{'variant':<26}{'stall/copy':>24}{'fsync write/persist':>24}{'cpu/floor':>24}{'cpu s/GiB':>24}")
    for name, r in rows.items():
        if is_loop(name):
            continue
        cells = [(r.get("stall_over_copy_paired"), r.get("stall_over_copy_ci")),
                 (r.get("persist_over_limit_paired"), r.get("persist_over_limit_ci")),
                 (r.get("cpu_over_floor"), r.get("cpu_over_floor_ci")),
                 (r.get("cpu_s_per_gib"), r.get("cpu_s_per_gib_ci"))]
        print(f"{name:<26}" + "".join(f"{C.fmt(v, '.2f') + ('' if not ci else ' ' + fmt_ci(ci)):>24}"
                                      for v, ci in cells))


def print_loops(suite: dict) -> None:
    loops = [(n, r) for n, r in suite["summary"]["rows"].items() if is_loop(n)]
    if not loops:
        return
    print(f"toy training loop, medians per period of {suite['loop']['every']} steps (base = no save; ckpt = save + "
          f"steps + wait until durable); overhead = sum(ckpt) / sum(base) - 1 over the rounds, 95% CI; "
          f"/t.save = overhead / torch.save's at the same thread count:")
    target = suite["loop"]["every"] * suite["loop"]["step_s_target"]
    for n, r in loops:
        ovh, ci = r["overhead"], r.get("overhead_ci")
        base = r.get("base_period_s")
        if base and not target / 2 <= base <= 2 * target:
            print(f"  note: {n}: base periods of {base:.2f}s, against {target:.3g}s targeted (the machine's load "
                  "differed while the step was calibrated)")
        vs = "" if r.get("over_torch_save") is None and not r.get("over_torch_save_ci") else (
            f"  /t.save {C.fmt(r.get('over_torch_save'), '.2f')} {fmt_ci(r.get('over_torch_save_ci'))}")
        print(f"  {n:<26} {C.fmt(r.get('threads'), 'd') if r.get('threads') else '?'}t  "
              f"base {C.fmt(r['base_period_s'], '.2f')}s  ckpt {C.fmt(r['ckpt_period_s'], '.2f')}s  "
              f"stall {C.fmt(r['loop_stall_s'], '.3f')}s  drain {C.fmt(r['drain_s'], '.2f')}s  "
              f"overhead {C.fmt(None if ovh is None else 100 * ovh, '+.1f')}% {fmt_ci(ci, '+.1f', 100)}{vs}  n={r['n']}")


def print_goals(goal_list: list) -> None:
    if not goal_list:
        return
    print("\ngoals (issue 18; PASS = the whole 95% CI meets the goal, MISS = the whole CI misses it, OPEN = the CI "
          "straddles it; reported, not asserted):")
    for g in goal_list:
        scale, spec = (100, "+.1f") if g["unit"] == "%" else (1, ".2f")
        value = C.fmt(None if g["value"] is None else scale * g["value"], spec)
        print(f"  [{g['status']:>4}] {g['goal']:<64} {g['variant']:<24} {value}{'' if g['unit'] == 'x' else g['unit']} "
              f"CI {fmt_ci(g['ci'], spec, scale)}  CI meets goal: {'yes' if g['ci_meets_goal'] else 'no'}")


def plot(payload: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    suites = payload["suites"]
    metrics = [("stall_s", "steady-state stall (s, log)", True, None),
               ("persist_over_limit", "persist throughput / storage limit (target >= 0.8)", False, 0.8),
               ("mem_net", "peak host memory / state (target <= 2.2)", False, 2.2),
               ("cpu_s_per_gib", "CPU per GiB written, all processes (s/GiB, goal <= 0.5)", False, 0.5),
               ("loop_overhead", "training overhead, save every ~10 s (%, target <= 5)", False, 5.0)]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(12, 3.2 * len(metrics)))
    names = [n for n in suites[0]["summary"]["rows"] if not is_loop(n)]
    width = 0.8 / len(suites)
    for ax, (key, title, log, target) in zip(axes, metrics):
        if target is not None:
            ax.axhline(target, ls="--", lw=1, color="gray")
        for j, suite in enumerate(suites):
            rows = suite["summary"]["rows"]
            vals = [rows.get(n, {}).get(key) for n in names]
            vals = [float("nan") if v is None else (100 * v if key == "loop_overhead" else v) for v in vals]
            ax.bar([i + j * width for i in range(len(names))], vals, width, label=f"{suite['ranks']} rank(s)")
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.set_xticks([i + width * (len(suites) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(f"ckpt save benchmark, state {payload['config']['size_bytes'] / C.GiB:.3g} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.save", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--size-gib", type=float, default=None, help="state size in GiB (default 1; --quick: 1/16)")
    p.add_argument("--tensor-mib", type=float, default=None, help="size of one tensor in MiB (default 64; --quick: 8)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1], help="rank counts to run, e.g. 1 2 (gloo, one host)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds of the save variants (default 4; --quick: 3)")
    p.add_argument("--loop-repeats", type=int, default=None,
                   help="interleaved rounds of the training-loop variants (default 10; --quick: 3)")
    p.add_argument("--saves", type=int, default=None, help="steady-state saves per variant and round, after the first (default 1)")
    p.add_argument("--writer-threads", type=int, default=None,
                   help="writer_threads of the ckpt[...] variants (default: the setting's default)")
    p.add_argument("--sweep-writer-threads", type=int, nargs="*", default=None,
                   help="extra ckpt[process,wt=N] variants, e.g. 1 2 (default: none)")
    p.add_argument("--loop-step-s", type=float, default=None, help="toy training step length in seconds (default 0.5; --quick: 0.02)")
    p.add_argument("--loop-every", type=int, default=None, help="steps between saves in the toy loop (default 20; --quick: 5)")
    p.add_argument("--loop-pairs", type=int, default=None,
                   help="pairs of (no-save, save) periods per toy loop and round (default 1)")
    p.add_argument("--loop-kinds", nargs="+", choices=LOOP_KINDS, default=list(DEFAULT_LOOP_KINDS), metavar="KIND",
                   help="ways to save in the toy loop (default: torch.save ckpt[bytes]; all: "
                        + " ".join(LOOP_KINDS) + ")")
    p.add_argument("--loop-threads", type=int, nargs="+", default=[0, 1],
                   help="training threads per rank in the toy loop, one loop variant each; 0 = the suite's "
                        "(--train-threads or every core) (default: 0 1, i.e. every core busy and 1 thread)")
    p.add_argument("--loop-ranks", type=int, nargs="+", default=[1],
                   help="rank counts whose suite runs the toy loop (default: 1)")
    p.add_argument("--matmul-n", type=int, default=512, help="matrix size of the toy training step")
    p.add_argument("--train-threads", type=int, default=None,
                   help="torch threads per rank (default: all cores split over the ranks; 1 leaves cores to the "
                        "background writer, as a GPU-bound trainer would)")
    p.add_argument("--no-loop", action="store_true", help="skip the training-overhead loop")
    p.add_argument("--variants", default="", help="comma-separated subset of variants to run (names as in the table)")
    p.add_argument("--isolation", choices=("variant", "round", "run"), default=None,
                   help="a fresh process per variant and round (default: honest first-save and peak-memory "
                        "figures), one per round, or one for the whole run (--quick; first-save and memory "
                        "figures then mix variants)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir under $TMPDIR)")
    p.add_argument("--mem-interval", type=float, default=0.02, help="host-memory sampling interval in seconds")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="64 MiB, 3 rounds, short loop, one process for all rounds: a 1-2 minute smoke run")
    a = p.parse_args(argv)
    q = a.quick
    a.size_bytes = int((a.size_gib if a.size_gib is not None else (1 / 16 if q else 1.0)) * C.GiB)
    a.tensor_bytes = int((a.tensor_mib if a.tensor_mib is not None else (8 if q else 64)) * C.MiB)
    a.repeats = a.repeats if a.repeats is not None else (3 if q else 4)
    a.loop_repeats = a.loop_repeats if a.loop_repeats is not None else (3 if q else 10)
    a.saves = a.saves if a.saves is not None else 1
    if a.writer_threads is None:
        from ckpt_core.config import CheckpointSettings

        a.writer_threads = CheckpointSettings().writer_threads
    a.sweep_writer_threads = a.sweep_writer_threads or []
    a.loop_step_s = a.loop_step_s if a.loop_step_s is not None else (0.02 if q else 0.5)
    a.loop_every = a.loop_every if a.loop_every is not None else (5 if q else 20)
    a.loop_pairs = a.loop_pairs if a.loop_pairs is not None else 1
    a.isolation = a.isolation or ("run" if q else "variant")
    return a


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    import tempfile

    C.exit_on_sigterm()

    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-save-")
    os.makedirs(args.dir, exist_ok=True)
    stamp = C.timestamp()
    log_path = C.RESULTS_DIR / f"save_{stamp}.log"
    t0 = time.time()
    print(f"checkpoints under {args.dir}; worker logs in {log_path}", flush=True)
    suites: list = []

    def payload() -> dict:
        return {
            "benchmark": "save", "timestamp": stamp, "wall_s": time.time() - t0, "machine": C.machine_info(),
            "config": {k: v for k, v in vars(args).items() if k != "worker"},
            "descriptions": DESCRIPTIONS, "suites": suites,
        }

    try:
        for ranks in args.ranks:
            suites.append(run_suite(args, ranks, log_path))
            print_table(suites[-1])
            if ranks != args.ranks[-1]:  # keep what is done if a later suite dies
                C.save_json(f"save_{stamp}.json", payload(), None)
    finally:
        if own_dir:
            C.rmtree(args.dir)
    if 2 not in args.ranks:
        print("\nnote: the goals at 2 ranks (persist, peak host memory) need a 2-rank suite: --ranks 1 2")
    final = payload()
    paths = C.save_json(f"save_{stamp}.json", final, args.out)
    png = None if args.no_plot else plot(final, C.RESULTS_DIR / f"save_{stamp}.png")
    print(f"\nwrote {', '.join(map(str, paths))}" + (f" and {png}" if png else " (no plot: matplotlib not importable)")
          + f" in {time.time() - t0:.0f}s")
    return 1 if any(s["failures"] for s in suites) else 0


if __name__ == "__main__":
    sys.exit(main())
