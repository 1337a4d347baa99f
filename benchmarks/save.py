"""Save benchmark: training stall, persist throughput, training overhead and host memory of every way to save.

    python -m benchmarks.save                 # 1 GiB state, 1 rank, 5 interleaved rounds
    python -m benchmarks.save --ranks 1 2     # also 2 ranks over gloo (state sharded, each rank holds half)
    python -m benchmarks.save --quick         # 64 MiB, 3 rounds, one worker per round: a smoke run (< 1 min)

One run measures, on the same state (``--size-gib`` of fp32 tensors, the
parameters of a plain ``nn.Module``):

* variants that save it: ``torch.save`` on rank 0 + fsync (what Lightning's and
  Accelerate's defaults do; at 2 ranks after gathering the full state to rank
  0), stock ``dcp.save`` (FileSystemWriter), stock ``dcp.async_save`` (thread and
  process), and this project's ``CheckpointManager`` in ``process``, ``thread``
  and ``off`` (synchronous) mode, plus ``process`` with a host-memory budget
  below the state size (it then saves synchronously);
* the machine's own limits, in the same run: a warm ``copy_`` of the same bytes
  into preallocated host buffers (staging limit) and an fsync'd sequential write
  of the same bytes (storage limit);
* the overhead on a toy training loop (matmuls on all cores, ``--loop-step-s``
  per step) of a save every ``--loop-every`` steps (about 10 s of training by
  default): periods with a save alternate with periods without one in the
  same process, so the shared machine's drift hits both alike.

Every variant runs in a fresh process per round (``--isolation variant``), so
its first save (process spawn, plan, buffer allocation) and its peak host
memory are its own; rounds are interleaved and the variant order rotates each
round; the table shows medians and ratios, and PASS/MISS against the targets
of issue 3. Results: ``benchmarks/results/save_<timestamp>.json`` (+ ``--out``)
and a PNG when matplotlib is importable. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

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
CKPT_BUDGET = "ckpt[process,budget]"
LOOP_PREFIX = "loop:"
LOOP_KINDS = (TORCH_SAVE, CKPT_OFF, CKPT_PROCESS, CKPT_THREAD)

DESCRIPTIONS = {
    LIMIT_COPY: "warm copy_ of the same bytes into preallocated host buffers (staging limit)",
    LIMIT_WRITE: "fsync'd sequential write of the same bytes, one file per rank (storage limit)",
    TORCH_SAVE: "torch.save of the full state on rank 0 + fsync (Lightning/Accelerate default)",
    DCP_SAVE: "stock dcp.save, FileSystemWriter defaults",
    DCP_ASYNC_THREAD: "stock dcp.async_save, thread executor, default stager (no buffer reuse)",
    DCP_ASYNC_PROCESS: "stock dcp.async_save, process executor, default stager (no buffer reuse)",
    CKPT_OFF: "CheckpointManager(async_mode='off'): synchronous DCP save + commit",
    CKPT_THREAD: "CheckpointManager(async_mode='thread')",
    CKPT_PROCESS: "CheckpointManager(async_mode='process'), the default",
    CKPT_BUDGET: "CheckpointManager(async_mode='process', max_host_memory_bytes=state/2): saves synchronously",
}


def ckpt_spec(name: str, default_wt: int) -> Optional[dict]:
    """``ckpt[process,wt=4]`` -> {'mode': 'process', 'wt': 4, 'budget': False}; None for other variants."""
    if not name.startswith("ckpt["):
        return None
    parts = name[5:-1].split(",")
    out = {"mode": parts[0], "wt": default_wt, "budget": False}
    for p in parts[1:]:
        if p == "budget":
            out["budget"] = True
        elif p.startswith("wt="):
            out["wt"] = int(p[3:])
    return out


def save_variants(args: argparse.Namespace) -> list[str]:
    names = [LIMIT_COPY, LIMIT_WRITE, TORCH_SAVE, DCP_SAVE, DCP_ASYNC_THREAD, DCP_ASYNC_PROCESS,
             CKPT_OFF, CKPT_THREAD, CKPT_PROCESS]
    names += [f"ckpt[process,wt={w}]" for w in args.sweep_writer_threads if w != args.writer_threads]
    names.append(CKPT_BUDGET)
    return names


def loop_variants(args: argparse.Namespace) -> list[str]:
    return [] if args.no_loop else [LOOP_PREFIX + k for k in LOOP_KINDS]


# ------------------------------------------------------------- worker side
class Ctx:
    def __init__(self, rank: int, world: int, spec: dict, model: Any, local: list, local_bytes: int) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        self.model, self.local, self.local_bytes = model, local, local_bytes
        self.root = spec["dir"]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


class Ops:
    """One way to save: ``start(i)`` (what training waits for), ``wait(handle)`` (until durable), ``cleanup(i)``."""

    has_persist = True

    def __init__(self, ctx: Ctx, kind: str, loop: bool = False) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.ctx, self.kind, self.loop = ctx, kind, loop
        self.root = os.path.join(ctx.root, _safe(kind) + ("_loop" if loop else ""))
        if ctx.rank == 0:
            os.makedirs(self.root, exist_ok=True)
        C.barrier()
        self.mgr = None
        self.extra: dict = {}
        model, rank = ctx.model, ctx.rank
        ck = ckpt_spec(kind, ctx.spec["writer_threads"])

        if kind == LIMIT_COPY:
            self.has_persist = False
            bufs = [torch.empty_like(t) for t in ctx.local]
            for b in bufs:
                b.fill_(0)  # fault the pages in: the limit is a *warm* copy

            def start(i: int) -> None:
                for b, t in zip(bufs, ctx.local):
                    b.copy_(t)

            self._start = start
        elif kind == LIMIT_WRITE:
            self._start = lambda i: C.fsync_write(self._path(i, f"rank{rank}.bin"), ctx.local)
            self._cleanup = lambda i: _unlink(self._path(i, f"rank{rank}.bin"))
        elif kind == TORCH_SAVE:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
            if rank == 0 and not loop:
                self._cleanup = lambda i: _unlink(self._path(i, "model.pt"))
        elif kind == DCP_SAVE:
            self._start = lambda i: dcp.save({"model": model.state_dict()},
                                             storage_writer=FileSystemWriter(self._dir(i)))
            self._cleanup = self._rm_dir
        elif kind in (DCP_ASYNC_THREAD, DCP_ASYNC_PROCESS):
            ctype = AsyncCheckpointerType.PROCESS if kind == DCP_ASYNC_PROCESS else AsyncCheckpointerType.THREAD
            self._start = lambda i: dcp.async_save({"model": model.state_dict()},
                                                   storage_writer=FileSystemWriter(self._dir(i)),
                                                   async_checkpointer_type=ctype)
            self._wait = lambda h: h.result()
            self._cleanup = self._rm_dir
        elif ck is not None:
            from ckpt_core import CheckpointManager, TrainState

            budget = max(1, ctx.local_bytes // 2) if ck["budget"] else None
            self.extra["max_host_memory_bytes"] = budget
            self.mgr = CheckpointManager(self.root, async_mode=ck["mode"], writer_threads=ck["wt"],
                                         max_host_memory_bytes=budget, keep_last=1 if loop else None,
                                         resume=False)
            state = TrainState(model=model)
            self._start = lambda i: self.mgr.save(i + 1, state)
            self._wait = lambda h: self.mgr.wait()
            if not loop:
                from ckpt_core.storage import step_dirname

                self._cleanup = lambda i: (C.rmtree(os.path.join(self.root, step_dirname(i + 1)))
                                           if rank == 0 else None)
        else:
            raise ValueError(f"unknown variant {kind!r}")
        del dist

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
    C.barrier()
    t0 = time.perf_counter()
    handle = ops.start(i)
    t1 = time.perf_counter()
    ops.wait(handle)
    t2 = time.perf_counter()
    C.barrier()
    ops.cleanup(i)
    return {"stall": t1 - t0, "persist": (t2 - t0) if ops.has_persist else None}


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
    process seconds later (median of 3), and its persist time compared with
    an fsync'd sequential write timed right after it.
    """
    import torch

    bufs = [torch.empty_like(t) for t in ctx.local]
    for b in bufs:
        b.fill_(0)
    copies = []
    for _ in range(3):
        C.barrier()
        t0 = time.perf_counter()
        for b, t in zip(bufs, ctx.local):
            b.copy_(t)
        copies.append(time.perf_counter() - t0)
    del bufs
    path = os.path.join(ctx.root, f"ref_rank{ctx.rank}.bin")
    writes = []
    for _ in range(2):  # the first fsync'd write of a process runs slower here: time the second, as 'steady'
        C.barrier()
        t0 = time.perf_counter()
        C.fsync_write(path, ctx.local)
        writes.append(time.perf_counter() - t0)
        _unlink(path)
    C.barrier()
    return {"copy_s": C.median(copies), "write_s": writes[-1]}


def make_work(ctx: Ctx):
    """One toy training step: ``k`` matmuls (calibrated by the harness) and, on several ranks, an all_reduce."""
    import torch
    import torch.distributed as dist

    n = ctx.spec["loop"]["matmul_n"]
    k = ctx.spec["loop"]["matmuls_per_step"]
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


def run_loop_variant(ctx: Ctx, name: str) -> dict:
    """Training overhead of saving every ``every`` steps, measured in pairs of periods in one process.

    A *ckpt* period is: save (the stall), ``every`` steps, then wait until that
    save is durable (a write longer than the period is overhead in steady state
    too). A *base* period is the same ``every`` steps without a save. Periods
    alternate (base/ckpt, then ckpt/base, ...), so the shared machine's drift
    hits both alike; overhead = sum(ckpt periods) / sum(base periods) - 1.
    """
    kind = name[len(LOOP_PREFIX):]
    lp = ctx.spec["loop"]
    every, pairs = lp["every"], lp["pairs"]
    ops = Ops(ctx, kind, loop=True)
    step = make_work(ctx)
    base_s, ckpt_s, stalls, drains = [], [], [], []
    try:
        ops.wait(ops.start(0))  # the first save (spawn, plan, buffers) is not part of the steady state
        step()
        n = 0
        for p in range(pairs):
            for what in (("base", "ckpt") if p % 2 == 0 else ("ckpt", "base")):
                C.barrier()
                t0 = time.perf_counter()
                if what == "ckpt":
                    n += 1
                    handle = ops.start(n)
                    stalls.append(time.perf_counter() - t0)
                for _ in range(every):
                    step()
                    ops.tick()
                if what == "ckpt":
                    td = time.perf_counter()
                    ops.wait(handle)
                    drains.append(time.perf_counter() - td)
                (ckpt_s if what == "ckpt" else base_s).append(time.perf_counter() - t0)
    finally:
        ops.close()
    return {"base_s": base_s, "ckpt_s": ckpt_s, "stalls": stalls, "drains": drains, "extra": ops.extra}


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
    ctx = Ctx(rank, world, spec, model, local, local_bytes)
    rounds = []
    for order in spec["rounds"]:
        rounds.append(_run_round(ctx, sampler, order, base_mem, base_rss))
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


def _run_round(ctx: Ctx, sampler: Any, order: list, base_mem: int, base_rss: int) -> dict:
    spec, rank = ctx.spec, ctx.rank
    out: dict = {}
    for name in order:
        C.barrier()
        sampler.window()
        t0 = time.perf_counter()
        try:
            res = run_loop_variant(ctx, name) if name.startswith(LOOP_PREFIX) else run_save_variant(ctx, name)
        except Exception:  # noqa: BLE001 - a failing variant is reported, the others still run
            res = {"error": C.format_exc()}
            print(f"[rank {rank}] {name} failed:\n{res['error']}", flush=True)
        time.sleep(3 * spec["mem_interval_s"])
        res["mem"] = {"peak": sampler.peak, "peak_rss": sampler.peak_rss, "base": base_mem,
                      "base_rss": base_rss, "samples": sampler.samples}
        if "error" not in res and not name.startswith(LOOP_PREFIX) and name not in (LIMIT_COPY, LIMIT_WRITE):
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


def merge_ranks(gathered: list, name: str, rnd: int = 0) -> dict:
    """One variant's result over ranks: per save the slowest rank; memory per rank."""
    per_rank = [g["rounds"][rnd][name] for g in gathered]
    errors = [r["error"] for r in per_rank if "error" in r]
    mem = []
    for g, r in zip(gathered, per_rank):
        m, lb = r["mem"], g["proc"]["local_bytes"]
        mem.append({"rank": g["rank"], "local_bytes": lb, "net": (m["peak"] - m["base"]) / lb,
                    "gross": m["peak"] / lb, "peak": m["peak"], "base": m["base"],
                    "peak_rss_sum": m["peak_rss"], "maxrss_self": g["proc"]["maxrss_self"],
                    "maxrss_children": g["proc"]["maxrss_children"], "samples": m["samples"]})
    out: dict = {"mem": mem, "mem_net": max(x["net"] for x in mem), "mem_gross": max(x["gross"] for x in mem)}
    if errors:
        out["error"] = errors[0]
        return out

    def slowest(key: str, items: list) -> Optional[float]:
        vals = [it[key] for it in items]
        return None if any(v is None for v in vals) else max(vals)

    if name.startswith(LOOP_PREFIX):
        for k in ("base_s", "ckpt_s", "stalls", "drains"):
            out[k] = [max(v) for v in zip(*[r[k] for r in per_rank])]
        out["overhead"] = sum(out["ckpt_s"]) / sum(out["base_s"]) - 1
        out["pair_overheads"] = [c / b - 1 for b, c in zip(out["base_s"], out["ckpt_s"])]
        out["extra"] = per_rank[0]["extra"]
        return out
    if all("ref" in r for r in per_rank):
        out["ref"] = {k: max(r["ref"][k] for r in per_rank) for k in ("copy_s", "write_s")}
    out["first"] = {k: slowest(k, [r["first"] for r in per_rank]) for k in ("stall", "persist")}
    out["steady"] = [{k: slowest(k, list(items)) for k in ("stall", "persist")}
                     for items in zip(*[r["steady"] for r in per_rank])]
    out["extra"] = per_rank[0]["extra"]
    return out


def run_suite(args: argparse.Namespace, ranks: int, log_path: Path) -> dict:
    cpus = os.cpu_count() or 1
    threads = args.train_threads or max(1, cpus // ranks)
    cal = calibrate(threads, args.matmul_n, args.loop_step_s)
    loop = {**cal, "every": args.loop_every, "pairs": args.loop_pairs, "step_s_target": args.loop_step_s}
    names = save_variants(args) + loop_variants(args)
    if args.variants:
        wanted = set(re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args.variants))  # commas inside [...] stay
        names = [n for n in names if n in wanted or n.split("[")[0] in wanted]
    base_spec = {
        "ranks": ranks, "threads": threads, "size_bytes": args.size_bytes, "tensor_bytes": args.tensor_bytes,
        "saves": args.saves, "writer_threads": args.writer_threads, "loop": loop,
        "mem_interval_s": args.mem_interval,
    }
    timeout = 300 + 120 * args.size_bytes / C.GiB * (1 + args.saves) + 6 * args.loop_step_s * args.loop_every * args.loop_pairs
    samples: dict[str, list] = {n: [] for n in names}
    failures: list[str] = []
    job = 0

    def run(rounds: list[list[str]], label: str) -> Optional[list]:
        nonlocal job
        job += 1
        d = os.path.join(args.dir, f"r{ranks}_job{job:03d}")
        os.makedirs(d, exist_ok=True)
        n = sum(len(r) for r in rounds)
        try:
            return C.run_worker("save", {**base_spec, "rounds": rounds, "dir": d, "label": label},
                                timeout=timeout * max(1, n // 3), log_path=log_path)
        except RuntimeError as e:
            failures.append(f"{label}: {e}")
            print(f"  ! {label} failed: {str(e).splitlines()[0]}", flush=True)
            return None
        finally:
            C.rmtree(d)

    print(f"\n== {ranks} rank(s): state {args.size_bytes / C.GiB:.3g} GiB in {len(C.layout(args.size_bytes, args.tensor_bytes))} "
          f"tensors, {threads} thread(s)/rank, {args.repeats} rounds, isolation={args.isolation}; "
          f"toy step {cal['matmuls_per_step']} x {cal['matmul_n']}^2 matmuls ~ {cal['matmuls_per_step'] * cal['matmul_s']:.2f}s, "
          f"save every {args.loop_every} steps", flush=True)
    if not args.quick:
        # Warm-up: one throwaway worker (file cache of the interpreter and torch, first-run costs of the
        # disk). Every worker also does one untimed-for-steady-state first save per variant.
        run([[LIMIT_COPY, LIMIT_WRITE]], "warm-up")
    orders = [names[k % len(names):] + names[:k % len(names)] for k in range(args.repeats)]
    if args.isolation == "run":  # one process for every round (--quick): fastest, least isolated
        t0 = time.time()
        g = run(orders, "all rounds")
        if g is not None:
            for rnd, order in enumerate(orders):
                for name in order:
                    samples[name].append(merge_ranks(g, name, rnd))
        print(f"  {args.repeats} rounds done in {time.time() - t0:.0f}s", flush=True)
    for rnd, order in enumerate(orders if args.isolation != "run" else []):
        t0 = time.time()
        if args.isolation == "variant":
            for name in order:
                g = run([[name]], f"round {rnd} {name}")
                if g is not None:
                    samples[name].append(merge_ranks(g, name))
        else:
            g = run([order], f"round {rnd}")
            if g is not None:
                for name in order:
                    samples[name].append(merge_ranks(g, name))
        print(f"  round {rnd + 1}/{args.repeats} done in {time.time() - t0:.0f}s", flush=True)
    return {"ranks": ranks, "threads_per_rank": threads, "calibration": cal, "loop": loop, "isolation": args.isolation,
            "variants": names, "samples": samples, "failures": failures,
            "summary": summarize(samples, names, args, ranks)}


# ------------------------------------------------------------------ summary
def summarize(samples: dict, names: list, args: argparse.Namespace, ranks: int) -> dict:
    total = args.size_bytes

    def ok(name: str) -> list:
        return [s for s in samples.get(name, []) if "error" not in s]

    rows: dict[str, dict] = {}
    for name in names:
        good = ok(name)
        if name.startswith(LOOP_PREFIX):
            rows[name] = {"overhead": C.median([x for s in good for x in s["pair_overheads"]]),
                          "overhead_per_round": [s["overhead"] for s in good],
                          "base_period_s": C.median([x for s in good for x in s["base_s"]]),
                          "ckpt_period_s": C.median([x for s in good for x in s["ckpt_s"]]),
                          "loop_stall_s": C.median([x for s in good for x in s["stalls"]]),
                          "drain_s": C.median([x for s in good for x in s["drains"]]),
                          "mem_net": C.median([s["mem_net"] for s in good]), "n": len(good)}
            continue
        rows[name] = {
            "first_stall_s": C.median([s["first"]["stall"] for s in good]),
            "first_persist_s": C.median([s["first"]["persist"] for s in good]),
            "stall_s": C.median([x["stall"] for s in good for x in s["steady"]]),
            "persist_s": C.median([x["persist"] for s in good for x in s["steady"]]),
            "mem_net": C.median([s["mem_net"] for s in good]),
            "mem_gross": C.median([s["mem_gross"] for s in good]),
            "n": len(good),
            # paired with the references measured in the same process (see measure_refs)
            "stall_over_copy_paired": C.median([C.median([x["stall"] for x in s["steady"]]) / s["ref"]["copy_s"]
                                                for s in good if "ref" in s]),
            "persist_over_limit_paired": C.median([s["ref"]["write_s"] / C.median([x["persist"] for x in s["steady"]])
                                                   for s in good if "ref" in s and s["steady"][0]["persist"]]),
        }
    copy_s = rows.get(LIMIT_COPY, {}).get("stall_s")
    write_s = rows.get(LIMIT_WRITE, {}).get("persist_s")
    tsave_s = rows.get(TORCH_SAVE, {}).get("stall_s")
    for name, r in rows.items():
        if name.startswith(LOOP_PREFIX):
            continue
        r["stall_over_copy_unpaired"] = C.ratio(r["stall_s"], copy_s)
        r["persist_over_limit_unpaired"] = C.ratio(write_s, r["persist_s"])
        r["stall_over_copy"] = r["stall_over_copy_paired"] or r["stall_over_copy_unpaired"]
        r["persist_over_limit"] = r["persist_over_limit_paired"] or r["persist_over_limit_unpaired"]
        r["stall_over_torch_save"] = C.ratio(r["stall_s"], tsave_s)
        r["persist_GBps"] = C.ratio(total / 1e9, r["persist_s"])
        loop = rows.get(LOOP_PREFIX + name)
        r["loop_overhead"] = loop.get("overhead") if loop else None
    return {"rows": rows, "targets": targets(rows, args), "state_bytes": total, "ranks": ranks}


def targets(rows: dict, args: argparse.Namespace) -> list[dict]:
    out = []

    def add(what: str, variant: str, value: Optional[float], limit: float, text: str, higher_is_better=False):
        status = "n/a" if value is None else (
            "PASS" if (value >= limit if higher_is_better else value <= limit) else "MISS")
        out.append({"target": what, "variant": variant, "value": value, "limit": limit, "status": status,
                    "text": text})

    for v, stock in ((CKPT_PROCESS, DCP_ASYNC_PROCESS), (CKPT_THREAD, DCP_ASYNC_THREAD)):
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


def print_table(suite: dict) -> None:
    s = suite["summary"]
    rows = s["rows"]
    hdr = (f"{'variant':<26}{'first':>8}{'stall':>8}{'/copy':>8}{'/t.save':>9}{'persist':>9}{'GB/s':>7}"
           f"{'/limit':>8}{'train+%':>9}{'mem/state':>10}{'n':>3}")
    print(f"\n-- {suite['ranks']} rank(s), state {s['state_bytes'] / C.GiB:.3g} GiB, "
          f"{suite['threads_per_rank']} torch thread(s)/rank (medians; seconds; first = first save of a fresh process; "
          f"/copy and /limit paired with a copy_ and a write timed in the same process) --")
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows.items():
        if name.startswith(LOOP_PREFIX):
            continue
        ovh = r.get("loop_overhead")
        print(f"{name:<26}{C.fmt(r['first_stall_s'], '.3f'):>8}{C.fmt(r['stall_s'], '.3f'):>8}"
              f"{C.fmt(r['stall_over_copy'], '.2f'):>8}{C.fmt(r['stall_over_torch_save'], '.3f'):>9}"
              f"{C.fmt(r['persist_s'], '.2f'):>9}{C.fmt(r['persist_GBps'], '.2f'):>7}"
              f"{C.fmt(r['persist_over_limit'], '.2f'):>8}{C.fmt(None if ovh is None else 100 * ovh, '+.1f'):>9}"
              f"{C.fmt(r['mem_net'], '.2f'):>10}{r['n']:>3}")
    loops = [(n[len(LOOP_PREFIX):], r) for n, r in rows.items() if n.startswith(LOOP_PREFIX)]
    if loops:
        print(f"toy training loop, medians per period of {suite['loop']['every']} steps "
              f"(base = no save; ckpt = save + steps + wait until durable):")
        for n, r in loops:
            print(f"  {n:<24} base {C.fmt(r['base_period_s'], '.2f')}s  ckpt {C.fmt(r['ckpt_period_s'], '.2f')}s  "
                  f"stall {C.fmt(r['loop_stall_s'], '.3f')}s  drain {C.fmt(r['drain_s'], '.2f')}s  "
                  f"overhead {C.fmt(None if r['overhead'] is None else 100 * r['overhead'], '+.1f')}%")
    print("\ntargets (issue 3; reported, not asserted):")
    for t in s["targets"]:
        print(f"  [{t['status']:>4}] {t['target']:<62} {t['variant']:<26} {t['text']}")
    if suite.get("isolation", "variant") != "variant":
        print(f"note: isolation={suite['isolation']}: variants share a process, so 'first' and 'mem/state' are "
              "not per-variant figures (use the default --isolation variant for those)")
    if suite["failures"]:
        print(f"\n{len(suite['failures'])} worker failure(s):")
        for f in suite["failures"]:
            print("  " + f.splitlines()[0])


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
               ("loop_overhead", "training overhead, save every ~10 s (%, target <= 5)", False, 5.0)]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(12, 3.2 * len(metrics)))
    names = [n for n in suites[0]["summary"]["rows"] if not n.startswith(LOOP_PREFIX)]
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
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5; --quick: 3)")
    p.add_argument("--saves", type=int, default=None, help="steady-state saves per variant and round, after the first (default 1)")
    p.add_argument("--writer-threads", type=int, default=None,
                   help="writer_threads of the ckpt[...] variants (default: the setting's default)")
    p.add_argument("--sweep-writer-threads", type=int, nargs="*", default=None,
                   help="extra ckpt[process,wt=N] variants (default: 1 2; --quick: none)")
    p.add_argument("--loop-step-s", type=float, default=None, help="toy training step length in seconds (default 0.5; --quick: 0.02)")
    p.add_argument("--loop-every", type=int, default=None, help="steps between saves in the toy loop (default 20; --quick: 5)")
    p.add_argument("--loop-pairs", type=int, default=None,
                   help="pairs of (no-save, save) periods per toy loop and round (default 2; --quick: 1)")
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
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 rounds, short loop, one process per round: < 1 minute")
    a = p.parse_args(argv)
    q = a.quick
    a.size_bytes = int((a.size_gib if a.size_gib is not None else (1 / 16 if q else 1.0)) * C.GiB)
    a.tensor_bytes = int((a.tensor_mib if a.tensor_mib is not None else (8 if q else 64)) * C.MiB)
    a.repeats = a.repeats if a.repeats is not None else (3 if q else 5)
    a.saves = a.saves if a.saves is not None else 1
    if a.writer_threads is None:
        from ckpt_core.config import CheckpointSettings

        a.writer_threads = CheckpointSettings().writer_threads
    a.sweep_writer_threads = a.sweep_writer_threads if a.sweep_writer_threads is not None else ([] if q else [1, 2])
    a.loop_step_s = a.loop_step_s if a.loop_step_s is not None else (0.02 if q else 0.5)
    a.loop_every = a.loop_every if a.loop_every is not None else (5 if q else 20)
    a.loop_pairs = a.loop_pairs if a.loop_pairs is not None else (1 if q else 2)
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
    final = payload()
    paths = C.save_json(f"save_{stamp}.json", final, args.out)
    png = None if args.no_plot else plot(final, C.RESULTS_DIR / f"save_{stamp}.png")
    print(f"\nwrote {', '.join(map(str, paths))}" + (f" and {png}" if png else " (no plot: matplotlib not importable)")
          + f" in {time.time() - t0:.0f}s")
    return 1 if any(s["failures"] for s in suites) else 0


if __name__ == "__main__":
    sys.exit(main())
