"""Shared machinery of the benchmark scripts.

* the benchmarked state: ``N`` fp32 tensors (64 MiB each by default) as the
  ``nn.Parameter``s of a plain module, sharded along dim 0 over the ranks as
  DTensors when there is more than one rank (every rank holds ``1/world`` of
  the state, as with FSDP);
* workers: every measurement runs in a fresh interpreter
  (``python -m benchmarks.<script> --worker spec.json``), with one process per
  rank (``torch.multiprocessing`` spawn over gloo) when ``ranks > 1``;
* host memory: a sampler thread sums the anonymous memory of a rank and all
  its descendants (DCP's background writer process included) plus shared
  memory once (the staging buffers), next to the exact ``ru_maxrss`` of the
  rank and of its children;
* CPU time: user + system time of a process tree from ``/proc`` (live
  children included, which ``getrusage`` cannot see), minus chosen threads
  (the samplers of the benchmark itself);
* storage: moto's S3 server in its own process on loopback (``MotoS3``, also
  the S3 server of ``tests/test_s3.py``);
* small helpers: fsync'd sequential writes (also split into the write and the
  fsync, each with its thread CPU time), page-cache eviction, medians,
  bootstrap confidence intervals and the PASS/MISS/OPEN of a goal against
  one (``goal_status``), machine description, result files.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------- state
def layout(size_bytes: int, tensor_bytes: int) -> list[int]:
    """Element counts (fp32) of the tensors making up a state of ``size_bytes``."""
    n_full, rest = divmod(size_bytes, tensor_bytes)
    sizes = [tensor_bytes // 4] * n_full
    if rest >= 4:
        sizes.append(rest // 4)
    return sizes


def build_model(size_bytes: int, tensor_bytes: int, rank: int, world: int, seed: int = 0):
    """The benchmarked module: fp32 parameters ``w000, w001, ...``; sharded (DTensor, Shard(0)) when world > 1.

    Returns ``(module, local_tensors, local_bytes)``: the tensors this rank
    holds (the local shards) and their size in bytes.
    """
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    model = nn.Module()
    local: list = []
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for i, numel in enumerate(layout(size_bytes, tensor_bytes)):
        numel -= numel % world
        shard = numel // world
        t = torch.empty(shard, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)
        local.append(t)
        if world > 1:
            from torch.distributed.tensor import DTensor, Shard

            p = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))
        else:
            p = t
        model.register_parameter(f"w{i:03d}", nn.Parameter(p, requires_grad=False))
    return model, local, sum(t.numel() * t.element_size() for t in local)


# ------------------------------------------------------------ distributed
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(rank: int, world: int, rdzv: Any) -> None:
    """A gloo process group (also for one rank: DCP's process mode needs one).

    ``rdzv`` is a FileStore path from ``run_ranks`` (no port to race for on a
    shared machine) or a TCP port on loopback.
    """
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    if isinstance(rdzv, str):
        dist.init_process_group("gloo", store=dist.FileStore(rdzv, world), rank=rank, world_size=world)
    else:
        os.environ["MASTER_PORT"] = str(rdzv)
        dist.init_process_group("gloo", rank=rank, world_size=world)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def stop_dcp_process() -> None:
    """Terminate the background checkpoint process (ours, and torch's if something started it) and reap it."""
    import gc

    from ckpt_core import background

    background.PROCESS.stop()
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:  # pragma: no cover - older torch
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    ape._CHECKPOINT_PROCESS = None
    try:
        proc.__del__()  # sends TERMINATE and joins (DCP's own shutdown path)
    except Exception:  # noqa: BLE001
        pass
    del proc
    gc.collect()


def finish_rank(world: int) -> None:
    """End a rank after its results are written: tear the group down, or, in a spawned rank, just exit.

    A spawned rank leaves with ``os._exit(0)``: tearing down gloo at interpreter
    exit after DCP's background threads sometimes aborts ("terminate called
    without an active exception"), which would fail a run whose measurements
    are complete.
    """
    import torch.distributed as dist

    if world > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def worker(spec_path: str, rank_main: Callable, **extra: Any) -> None:
    """A worker process: quiet the logs, read the spec (plus ``extra``), run ``rank_main`` on every rank."""
    import logging

    logging.getLogger().setLevel(logging.WARNING)
    with open(spec_path) as f:
        spec = {**json.load(f), **extra}
    run_ranks(rank_main, spec["ranks"], spec)


def run_ranks(fn: Callable[[int, int, Any, dict], None], world: int, spec: dict) -> None:
    """Run ``fn(rank, world, rdzv, spec)`` on ``world`` ranks: in this process for one rank, else spawned.

    ``rdzv`` is a fresh FileStore path for ``init_dist``.
    """
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-store-")
    rdzv = os.path.join(tmp, "store")
    try:
        if world == 1:
            fn(0, 1, rdzv, spec)
            return
        import torch.multiprocessing as mp

        mp.start_processes(fn, args=(world, rdzv, spec), nprocs=world, join=True, start_method="spawn")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------- memory
def _status_kib(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def rss_bytes(pid: int) -> int:
    return _status_kib(pid).get("VmRSS", 0) * 1024


def pss_bytes(pid: int) -> int:
    """PSS from smaps_rollup (exact for shared pages, but ~10 ms per read for a process with torch loaded)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss_bytes(pid)


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid`` (``/proc/<pid>/task/*/children``; psutil when that is unavailable)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        kids: set[int] = set()
        ok = False
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids.update(int(x) for x in f.read().split())
                ok = True
            except (OSError, ValueError):
                continue
        if not ok and p == pid:
            try:
                import psutil

                return [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except Exception:  # noqa: BLE001 - processes come and go
                return []
        out.extend(sorted(kids))
        todo.extend(kids)
    return out


def tree_memory(pids: list[int]) -> tuple[int, int]:
    """(host memory, summed RSS) of a process tree.

    Host memory is the anonymous memory of every process plus shared memory
    counted once (the largest ``RssShmem``: DCP's process mode maps the same
    staging buffers in the trainer and in the writer). File-backed pages
    (libraries, shared with other processes and reclaimable) are left out, so
    this is what the tree adds to the machine, cheap enough to sample every
    20 ms (``/proc/<pid>/status``). Summed RSS counts shared pages once per
    process and is an upper bound.
    """
    anon, shmem, rss = 0, 0, 0
    for p in pids:
        st = _status_kib(p)
        anon += st.get("RssAnon", 0)
        shmem = max(shmem, st.get("RssShmem", 0))
        rss += st.get("VmRSS", 0)
    return (anon + shmem) * 1024, rss * 1024


class MemSampler:
    """Samples the host memory of this process and its descendants every ``interval`` seconds.

    See ``tree_memory``: anonymous memory of every process plus shared memory
    once (DCP's writer process included). ``window()`` starts a new peak window
    (one variant).
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.pid = os.getpid()
        self._pids = [self.pid]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.peak = 0
        self.peak_rss = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    def current(self) -> tuple[int, int]:
        return tree_memory([self.pid, *descendants(self.pid)])

    def start(self) -> "MemSampler":
        self._thread.start()
        return self

    @property
    def native_id(self) -> Optional[int]:
        """The sampler thread's kernel thread id (once started): its CPU is the benchmark's, not a save's."""
        return self._thread.native_id

    def window(self) -> None:
        with self._lock:
            self.peak, self.peak_rss, self.samples = 0, 0, 0

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            if i % 10 == 0:
                self._pids = [self.pid, *descendants(self.pid)]
            mem, rss = tree_memory(self._pids)
            with self._lock:
                self.peak = max(self.peak, mem)
                self.peak_rss = max(self.peak_rss, rss)
                self.samples += 1
            i += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# -------------------------------------------------------------------- CPU
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_ticks(path: str, children: bool) -> int:
    """utime + stime (+ cutime + cstime when ``children``) in clock ticks from a ``/proc/.../stat`` file; 0 if gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return 0
    fields = data[data.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
    try:  # fields 14-17 of proc(5), counted from the state (field 3)
        return sum(int(x) for x in fields[11:15 if children else 13])
    except (ValueError, IndexError):
        return 0


def tree_cpu_s(pid: int, exclude_tids: tuple = (), tree: bool = True) -> float:
    """CPU seconds (user + system) used so far by ``pid``, its threads and, with ``tree``, all its descendants.

    Read from ``/proc/<pid>/stat``: the process's threads, dead ones included,
    and the children it has reaped (cutime/cstime), so a difference of two
    readings covers a live writer process that ``getrusage(RUSAGE_CHILDREN)``
    cannot see yet. ``exclude_tids`` are threads of ``pid`` left out (the
    benchmark's own samplers). Resolution: one clock tick (10 ms).
    """
    pids = [pid, *descendants(pid)] if tree else [pid]
    ticks = sum(_stat_ticks(f"/proc/{p}/stat", children=True) for p in pids)
    ticks -= sum(_stat_ticks(f"/proc/{pid}/task/{t}/stat", children=False) for t in exclude_tids)
    return ticks / CLK_TCK


def maxrss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


_PAGE = os.sysconf("SC_PAGE_SIZE")


def statm_rss(anon: bool = False) -> int:
    """RSS of this process in bytes, from ``/proc/self/statm`` (a few microseconds per read).

    ``anon=True``: resident minus file-backed/shared pages (the process's own memory, without the
    library pages that a first call into torch code faults in).
    """
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    return (int(fields[1]) - (int(fields[2]) if anon else 0)) * _PAGE


class RssMeter:
    """Peak RSS of this process above a baseline, sampled from ``/proc/self/statm`` every ``interval`` s.

    The baseline is the RSS when the meter is created (after imports).
    ``mark(name)`` closes a phase: it records the RSS now and the peak since the
    previous mark, both above the baseline. ``ru_maxrss`` (the kernel's exact
    high-water mark, which cannot miss a short peak but also holds peaks from
    before the baseline) is reported next to the sampled peak.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.baseline = statm_rss()
        self.baseline_anon = statm_rss(anon=True)
        self.maxrss_at_baseline = maxrss_bytes()
        self.peak = self._phase_peak = self.baseline
        self.phases: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-meter", daemon=True)

    def start(self) -> "RssMeter":
        self._thread.start()
        return self

    def _sample(self) -> int:
        rss = statm_rss()
        with self._lock:
            self.peak = max(self.peak, rss)
            self._phase_peak = max(self._phase_peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def mark(self, name: str) -> None:
        rss = self._sample()
        with self._lock:
            self.phases.append({"phase": name, "rss": rss - self.baseline, "peak": self._phase_peak - self.baseline,
                                "anon": statm_rss(anon=True) - self.baseline_anon})
            self._phase_peak = rss

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join(timeout=2)

    def added_after(self, name: str) -> Optional[int]:
        """The peak RSS after the mark ``name`` above the RSS at that mark (what the phases after it added), or
        None without that mark."""
        at = next((i for i, p in enumerate(self.phases) if p["phase"] == name), None)
        if at is None:
            return None
        with self._lock:
            running = self._phase_peak - self.baseline  # the peak since the last mark
        later = [p["peak"] for p in self.phases[at + 1 :]] + [self.phases[at]["rss"], running]
        return max(later) - self.phases[at]["rss"]

    def result(self, state_bytes: int, after: Optional[str] = None) -> dict:
        """Peak RSS above the baseline, also as a ratio to ``state_bytes``; phase marks in MiB; with ``after``, what
        the phases after that mark added (``added_after``), and as a ratio."""
        peak = self.peak - self.baseline
        maxrss = maxrss_bytes() - self.baseline
        added = None if after is None else self.added_after(after)
        return {
            "added_after": added,
            "added_after_ratio": added / state_bytes if added is not None and state_bytes else None,
            "state_bytes": state_bytes,
            "baseline_rss": self.baseline,
            "peak_rss_added": peak,
            "maxrss_added": maxrss,
            "rss_ratio": peak / state_bytes if state_bytes else None,
            "maxrss_ratio": maxrss / state_bytes if state_bytes else None,
            "phases_mib": [{k: (v if k == "phase" else round(v / MiB, 1)) for k, v in p.items()} for p in self.phases],
        }


def import_lazy_modules(world: int, optimizer: bool = False) -> None:
    """Import what building the benchmarked state imports on first use, so an RSS baseline taken after it holds code only.

    ``torch._dynamo`` (about 25 MiB of Python objects, 0.8 s) comes in with the
    first DTensor (``world > 1``) or optimizer; left to the build, it would be
    counted as memory of the state.
    """
    if world > 1 or optimizer:
        import torch._dynamo  # noqa: F401


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state dict (the local shards of DTensors)."""
    import torch

    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        t = obj.to_local() if isinstance(obj, DTensor) else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# ----------------------------------------------------------------- storage
def fsync_write(path: str, tensors: list, chunk: int = 64 * MiB) -> int:
    """Write the bytes of ``tensors`` sequentially to ``path`` and fsync it (the storage limit); the bytes written."""
    return timed_write(path, tensors, chunk)["bytes"]


def timed_write(path: str, tensors: list, chunk: int = 64 * MiB) -> dict:
    """``fsync_write`` in two timed phases: the write syscalls (a copy into the page cache), then the fsyncs.

    Returns wall and thread CPU seconds of each phase (``write_s``/``write_cpu_s``,
    ``fsync_s``/``fsync_cpu_s``; the fsyncs include the directory's) and their
    total wall time ``total_s``, and the ``bytes`` written. Writeback done by
    kernel threads is nobody's thread CPU time and is not counted.
    """
    t0, c0 = time.perf_counter(), time.thread_time()
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            mv = memoryview(t.numpy()).cast("B")
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off : off + chunk])
            n += len(mv)
        t1, c1 = time.perf_counter(), time.thread_time()
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    t2, c2 = time.perf_counter(), time.thread_time()
    return {"write_s": t1 - t0, "write_cpu_s": c1 - c0, "fsync_s": t2 - t1, "fsync_cpu_s": c2 - c1,
            "total_s": t2 - t0, "bytes": n}


def evict_page_cache(root: str) -> int:
    """Drop the cached pages of every file under ``root`` (posix_fadvise DONTNEED), so reads hit the disk.

    Only this benchmark's files are touched (no global drop_caches). Returns
    the number of bytes advised.
    """
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            except OSError:
                pass
            finally:
                os.close(fd)
    return total


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class MotoS3:
    """moto's S3 server (``python -m moto.server``) in its own process on a loopback port, with one bucket.

    No network beyond loopback. ``options`` are the fsspec storage options
    (s3fs) that reach it. ``close()`` (or leaving the ``with`` block) stops it;
    the objects are held by that process and go with it.
    """

    def __init__(self, bucket: str = "ckpt-bench", timeout: float = 30.0) -> None:
        import socket

        self.bucket = bucket
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"moto's S3 server did not start on port {self.port} "
                                       "(is the s3 extra installed: moto[server], s3fs, boto3?)")
                time.sleep(0.1)
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-east-1"}}
        import boto3

        boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                     **self.options["client_kwargs"]).create_bucket(Bucket=bucket)

    def url(self, *names: str) -> str:
        return "/".join([f"s3://{self.bucket}", *names])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "MotoS3":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------- workers
def run_worker(module: str, spec: dict, timeout: float, log_path: Path) -> dict:
    """Run ``python -m benchmarks.<module> --worker <spec>`` in a fresh process group; return its result JSON.

    On timeout the whole process group (the worker, its ranks and their
    writer processes) is killed. Raises ``RuntimeError`` with the log tail when
    the worker fails.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-spec-") as tmp:
        spec = dict(spec, result_path=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(log_path, "ab") as log:
            log.write(f"\n===== {module} {spec.get('label', '')} =====\n".encode())
            log.flush()
            proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", "--worker", spec_path],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"worker timed out after {timeout:.0f}s; see {log_path}")
            except BaseException:  # interrupted: take the worker's process group down with us
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            finally:
                # Reap any straggler of this worker's process group (e.g. an orphaned writer process).
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if rc != 0 or not os.path.exists(spec["result_path"]):
            raise RuntimeError(f"worker failed (rc={rc}):\n{tail(log_path)}")
        with open(spec["result_path"]) as f:
            return json.load(f)


def tail(path: Path, n: int = 3000) -> str:
    try:
        data = Path(path).read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode(errors="replace")


def write_result(spec: dict, result: Any) -> None:
    with open(spec["result_path"] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(spec["result_path"] + ".tmp", spec["result_path"])


def format_exc() -> str:
    return traceback.format_exc(limit=8)


# ----------------------------------------------------------------- numbers
def median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def bootstrap_ci(samples: Any, stat: Callable[[Any], float], n: int = 2000, seed: int = 0,
                 level: float = 0.95) -> Optional[tuple[float, float]]:
    """Percentile bootstrap confidence interval of ``stat`` over ``samples``; None with fewer than 2 samples.

    ``samples`` holds one entry per independent unit (a round): a number, or a
    row of paired numbers (e.g. a variant's time and the reference timed in
    the same process). ``stat`` maps an array of entries (shape ``(m,)`` or
    ``(m, k)``) to a number. Rows are resampled with replacement, ``n`` times,
    with a fixed seed (the same data give the same interval). The bounds are
    resampled values (the lower and upper percentile points, never
    interpolated), so an infinite statistic (a ratio over a denominator that
    is not positive) gives an infinite bound. Resamples where ``stat`` is NaN
    are left out; None when they are more than ``1 - level`` of them.
    """
    import numpy as np

    data = np.asarray(samples, dtype=float)
    if len(data) < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, len(data), size=(n, len(data)))
    with np.errstate(all="ignore"):
        vals = np.array([stat(data[i]) for i in idx], dtype=float)
    vals = vals[~np.isnan(vals)]
    if vals.size == 0 or vals.size < level * n:
        return None
    tail = 100 * (1 - level) / 2
    lo = np.percentile(vals, tail, method="lower")
    hi = np.percentile(vals, 100 - tail, method="higher")
    return float(lo), float(hi)


def ratio_of_sums(a: Any) -> float:
    """``sum(column 0) / sum(column 1)`` of paired rows: a ratio of totals over rounds (nan if the total is 0)."""
    den = float(a[:, 1].sum())
    return float(a[:, 0].sum()) / den if den else float("nan")


def goal_status(ci: Optional[tuple], limit: float, higher_is_better: bool = False) -> str:
    """A goal against a confidence interval: PASS when the whole CI meets ``limit``, MISS when the whole CI misses
    it, OPEN when the CI straddles it, ``n/a`` without a CI."""
    if ci is None:
        return "n/a"
    lo, hi = ci
    met, missed = (lo >= limit, hi < limit) if higher_is_better else (hi <= limit, lo > limit)
    return "PASS" if met else ("MISS" if missed else "OPEN")


def fmt(x: Optional[float], spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def machine_info() -> dict:
    import torch

    info = {
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
    }
    try:
        import psutil

        info["host_memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def save_json(name: str, payload: dict, out: Optional[str]) -> list[Path]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    paths = [RESULTS_DIR / name]
    if out:
        paths.append(Path(out))
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w") as f:
            json.dump(payload, f, indent=2)
    return paths


def parse_size(text: str) -> int:
    """``1``/``0.0625`` are GiB; ``64M``/``512MiB``/``2G`` carry a unit."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = GiB
    if t.endswith("k"):
        mult, t = 1 << 10, t[:-1]
    elif t.endswith("m"):
        mult, t = MiB, t[:-1]
    elif t.endswith("g"):
        mult, t = GiB, t[:-1]
    return int(float(t) * mult)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in the harness, so ``finally`` blocks kill workers and remove temp dirs."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
