"""Recovery benchmark: time from process start to the first resumed training step, and the work lost per failure,
for the durable tier alone and for the local tier + the durable tier.

    python -m benchmarks.recovery                 # 1 GiB state, 1 rank, 5 kill/resume cycles of both variants
    python -m benchmarks.recovery --ranks 2       # 2 ranks over gloo (state sharded; snapshots replicated)
    python -m benchmarks.recovery --storage s3 --ranks 2 --size-gib 0.25   # durable tier on moto's S3 server
    python -m benchmarks.recovery --tiers durable # the durable tier alone (the benchmark before the local tier)
    python -m benchmarks.recovery --quick         # 64 MiB, 2 cycles: a smoke run

Every cycle draws one kill step (uniform in ``[2, 5) * every``) and runs it
for each variant of ``--tiers``, back to back, the order alternating from one
cycle to the next:

* ``durable``: a save every ``--every`` steps (``CheckpointManager(async_mode=...)``,
  ``keep_last=2``);
* ``local``: a durable save every ``--local-durable-every`` steps (default
  ``--every``: the same; a sparser cadence pays for the snapshots, so that
  both variants train at the same overhead), plus a local-tier snapshot
  every ``--local-every`` steps (default ``--every / 5``) into a fresh temporary directory under
  ``--local-dir`` (default ``/dev/shm``, removed at the end). Each rank is a
  node of its own (``local_node_size=1``, ``local_dir=<dir>/node<rank>``), so
  with ``--ranks 2`` every snapshot is replicated to the other rank's "node"
  (``replication_factor=2``) and the replication traffic is measured. Every
  variant of a cycle has a fixed ``run_id``, so the relaunch finds its
  snapshots.

The durable tier goes to a directory on disk (``--dir``; its files are evicted
from the page cache before each resume, ``--warm`` keeps them) or, with
``--storage s3``, to moto's S3 server (``_common.MotoS3``: ``python -m
moto.server`` on loopback, as ``tests/test_s3.py`` starts it, in its own
process on the same cores).

Each variant of a cycle:

1. *train*: a fresh training process first runs ``--baseline-steps`` toy
   steps (matmuls of ``--step-s``) without checkpointing and times a warm
   ``copy_`` of its state, then trains with the manager (``maybe_save`` every
   step) until it is killed with SIGKILL at the cycle's step. The whole
   process group dies, DCP's writer process included, as on a node failure;
   the local tier's files in ``/dev/shm`` stay, as node memory outlives a
   process.
2. *work lost*: steps completed before the kill minus the step the resume
   restored (and in seconds: from the end of that step to the end of the last
   one, in the trainer's own clock). The restored step must be the newest
   committed durable checkpoint or complete local snapshot found after the kill.
3. *resume*: a fresh process calls ``manager.resume(state)`` and runs one
   training step. The time from launch to the end of that step is split into:
   interpreter + imports, process group, model construction, manager
   creation, the restore's phases, then the first step. A durable restore's
   phases are ``CheckpointManager.last_restore_timings`` (discover = listing +
   choosing + validating, load = DCP load into the live tensors (``--load
   fresh``: into fresh buffers), apply = set_state_dict etc., verify =
   fingerprints and checks). A local restore sets no
   timings, so the worker wraps the local tier's methods (in its own process;
   ``ckpt_core`` is not changed): discover = the durable tier's listing + the
   scan and agreement, load = read (or receive) + CRC32C + fresh buffers, apply,
   verify = the live state's fingerprint. The resume's host memory is measured
   too: ``restore_rss_ratio`` is the peak RSS that the process group, building
   the state and restoring it add above the RSS after imports (sampled every 2
   ms, ``_common.RssMeter``), divided by the state's bytes on the rank (worst
   rank), and ``restore_only_ratio`` what the restore alone added above the
   RSS right before it. The floors are 1.0 and 0 for a durable restore in
   place (the live state; the read's buffers come on top), 2.0 and 1.0 with
   ``--load fresh`` and for a local restore (the fresh buffers loaded before
   anything is applied).
4. *limits*: right after the resume, the restored bytes are read once more,
   front to back, in 64 MiB reads: a durable checkpoint's files evicted from
   the page cache again, twice, buffered and with ``O_DIRECT``, the faster of
   the two counting (on S3: its objects through s3fs), a local snapshot's
   slot files from node memory. The load is reported against that read (its
   time divided by the load's: the goal for the durable tier on disk is at
   least 0.8x) and the verify against the load (goal at most 15 %).
5. *training overhead*: the mean training step (compute + ``maybe_save``)
   over the mean baseline step of the same process (the first
   ``WARMUP_STEPS`` left out), minus 1. Also: the snapshot's stall
   (``LocalTier.last_stall_s``) once its slots are faulted in, against the warm
   ``copy_`` of the same bytes; ``maybe_save`` on the durable save steps (from
   the second: the first also starts the writer) and the durable save's write
   time; the local tier's background work per snapshot (seal = CRC32C,
   fingerprint and commit; replication round) and the steps that ran while it
   did (the replication traffic's effect on the training loop) against the
   other steps.

Medians over the cycles per variant. The variants are compared cycle by
cycle (same kill step, back to back): ratios of totals over the cycles with
bootstrap 95 % confidence intervals (``_common.bootstrap_ci``), and the goals
as PASS (the whole CI meets the goal), MISS (the whole CI misses it) or OPEN:
recovery from the local tier <= 0.5x the durable tier's restore time (with the
durable tier on S3; ``n/a`` on disk), work lost per failure (seconds) <= 1/5 of
the durable tier's, at the same training overhead (local + durable at most
``--overhead-tolerance``, 1 point, above durable only). JSON in
``benchmarks/results/recovery_<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

T_IMPORT0 = time.time()  # as early as this module allows: the worker's interpreter is already up

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _common as C  # noqa: E402

PHASES = ("interpreter", "imports", "process_group", "build_model", "manager", "discover", "load", "apply",
          "verify", "restore_other", "first_step")
TIERS = ("durable", "local")
LABELS = {"durable": "durable only", "local": "local + durable"}
WARMUP_STEPS = 2  # baseline steps left out of its mean (first calls into the kernels)


# ------------------------------------------------------------- worker side
def _work(spec: dict, rank: int, world: int):
    import torch
    import torch.distributed as dist

    n, k = spec["matmul_n"], spec["matmuls_per_step"]
    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    grad = torch.zeros(1024)

    def step(model: Any) -> None:
        for _ in range(k):
            torch.mm(a, b, out=c)
        with torch.no_grad():  # the state changes every step, so every checkpoint differs
            next(iter(model.parameters())).add_(1e-3)
        if world > 1:
            dist.all_reduce(grad)

    return step


def local_settings(spec: dict, rank: int) -> dict:
    """The manager's local-tier settings of this rank (none for the durable-only variant).

    Each simulated node (``node_size`` ranks) has its own ``local_dir`` under the variant's directory, so
    with ``node_size=1`` and 2 ranks every snapshot is replicated to the other rank's "node".
    """
    loc = spec.get("local")
    if not loc:
        return {}
    return {"local_every_n_steps": loc["every"], "local_dir": os.path.join(loc["dir"], f"node{rank // loc['node_size']}"),
            "local_node_size": loc["node_size"], "replication_factor": loc["factor"]}


def _timed(owner: Any, name: str, into: dict, key: str, result_key: Optional[str] = None) -> None:
    """Wrap ``owner.name`` so that its seconds add up in ``into[key]`` (and whether it returned something).

    Nothing is wrapped when ``owner`` has no ``name`` (another version of the library): that part of the
    timings is then missing, the rest still adds up.
    """
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn(*a, **k)
            if result_key is not None:
                into[result_key] = out is not None
            return out
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _recovery_class(name: str) -> Any:
    """The class whose method ``name`` a local recovery runs: ``local_recovery.Recovery``, or ``LocalTier``."""
    from ckpt_core.local_tier import LocalTier

    try:
        from ckpt_core.local_recovery import Recovery
    except ImportError:
        return LocalTier
    return Recovery if hasattr(Recovery, name) else LocalTier


def instrument_local(restore: dict, background: Any) -> None:
    """Time the local tier from outside, in this worker only (``ckpt_core`` is not changed).

    ``restore``: seconds of the durable tier's listing (``list_records``, once per restore), the local recovery
    as a whole, its fetch (read + CRC32C + fresh buffers), its apply and the fingerprint of the live state after
    it.
    ``background``: a deque that gets ``{step, seal_s, replicate_s, t}`` as each snapshot's background work ends.
    """
    import ckpt_core.local_snapshot as snap
    import ckpt_core.manager as manager
    from ckpt_core.local_tier import LocalTier

    _timed(manager, "list_records", restore, "durable_listing")
    _timed(LocalTier, "recover", restore, "recover", result_key="from_local")
    _timed(_recovery_class("_fetch"), "_fetch", restore, "fetch")
    _timed(_recovery_class("_apply"), "_apply", restore, "apply_all")
    _timed(snap, "live_fingerprint", restore, "verify")
    rounds: dict = {}
    _timed(LocalTier, "_replicate", rounds, "replicate_s")
    seal_and_replicate = LocalTier._seal_and_replicate

    def wrapped(self: Any, step: int, *a: Any, **k: Any) -> Any:
        rounds.clear()
        t0 = time.perf_counter()
        try:
            return seal_and_replicate(self, step, *a, **k)
        finally:
            total = time.perf_counter() - t0
            rep = rounds.get("replicate_s", 0.0)
            background.append({"step": step, "seal_s": total - rep, "replicate_s": rep, "t": time.time()})

    LocalTier._seal_and_replicate = wrapped


def warm_copy_s(tensors: list, repeats: int = 3) -> float:
    """Median seconds of a warm ``copy_`` of ``tensors`` into buffers of their own (touched by a first copy)."""
    import torch

    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        if i:
            times.append(time.perf_counter() - t0)
    del dst
    return C.median(times)


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    marks = {"t_worker": spec["_t_worker"]}
    import collections

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401

    from ckpt_core import CheckpointManager, TrainState

    C.import_lazy_modules(world)
    restore_t: dict = {}
    background: collections.deque = collections.deque()
    if spec.get("local"):
        instrument_local(restore_t, background)
    marks["t_imports"] = time.time()
    meter = C.RssMeter().start() if spec["role"] == "resume" else None  # baseline: the RSS after imports
    C.init_dist(rank, world, port)
    torch.set_num_threads(spec["threads"])
    marks["t_pg"] = time.time()
    model, tensors, local_bytes = C.build_model(spec["size_bytes"], spec["tensor_bytes"], rank, world, seed=1)
    marks["t_model"] = time.time()
    mgr = CheckpointManager(spec["root"], async_mode=spec["async_mode"], writer_threads=spec["writer_threads"],
                            restore_in_place=spec.get("restore_in_place", True),
                            every_n_steps=spec["every"], keep_last=2, run_id=spec["run_id"],
                            storage_options=spec.get("storage_options") or {}, **local_settings(spec, rank))
    state = TrainState(model=model)
    marks["t_manager"] = time.time()
    step_fn = _work(spec, rank, world)
    out: dict = {"rank": rank, "local_bytes": local_bytes}
    if spec["role"] == "resume":
        meter.mark("built")
        t0 = time.time()
        rec = mgr.resume(state)
        marks["t_restored"] = time.time()
        meter.stop()
        out["rss"] = meter.result(local_bytes, after="built")
        out["restore_s"] = marks["t_restored"] - t0
        out["from_local"] = bool(restore_t.get("from_local"))
        out["timings"] = local_phases(restore_t) if out["from_local"] else \
            dict(getattr(mgr, "last_restore_timings", {}) or {})
        out["local_timings"] = dict(restore_t)
        out["restored_step"] = None if rec is None else rec.step
        step_fn(model)
        marks["t_first_step"] = time.time()
        out["marks"] = marks
        gathered = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            C.write_result(spec, gathered)
        mgr.close()
        C.stop_dcp_process()
        dist.barrier()
        C.finish_rank(world)
        return
    # role == "train": the baseline (steps without the manager) and the warm copy_ of the rank's state, then
    # training until killed (or max_steps).
    progress = None
    if rank == 0:
        progress = os.open(spec["progress"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    base = []
    for _ in range(spec["baseline_steps"]):
        t0 = time.time()
        step_fn(model)
        base.append(time.time() - t0)
    copy_s = warm_copy_s(tensors)
    C.barrier()
    if progress is not None:
        os.write(progress, json.dumps({"step": 0, "baseline": base, "copy_s": copy_s,
                                       "local_bytes": local_bytes}).encode() + b"\n")
    tier = mgr._local
    step = 0
    committed = None
    while step < spec["max_steps"]:
        step += 1
        busy = tier is not None and tier._pending is not None and not tier._pending.done()
        t0 = time.time()
        step_fn(model)
        t1 = time.time()
        mgr.maybe_save(step, state)
        t2 = time.time()
        if progress is not None:
            last = mgr.last_save_stats
            line = {"step": step, "t": t2, "dt": t2 - t0, "save_call_s": t2 - t1, "busy": busy,
                    "committed": None if last is None else last.step}
            if last is not None and last.step != committed:  # a durable save committed: its write to storage
                committed = last.step
                line.update(write_s=last.write_s, write_bytes=last.bytes)
            if tier is not None and tier.last_step == step:
                line["stall"] = tier.last_stall_s
            if background:
                line["background"] = [background.popleft() for _ in range(len(background))]
            os.write(progress, json.dumps(line).encode() + b"\n")
    mgr.close()
    C.finish_rank(world)


def local_phases(t: dict) -> dict:
    """A restore from the local tier in the durable restore's phases: discover = the durable tier's listing and
    the local scan and choice; load = read, CRC32C and fresh buffers; apply; verify = the live fingerprint."""
    apply_all, verify = t.get("apply_all", 0.0), t.get("verify", 0.0)
    return {"discover": t.get("durable_listing", 0.0) + t.get("recover", 0.0) - t.get("fetch", 0.0) - apply_all,
            "load": t.get("fetch", 0.0), "apply": apply_all - verify, "verify": verify, "fingerprint": verify}


def worker_main(spec_path: str) -> None:
    C.worker(spec_path, rank_main, _t_worker=T_IMPORT0)


# -------------------------------------------------------------- harness side
def _launch(spec: dict, log_path: Path, tmp: str) -> tuple[subprocess.Popen, str]:
    spec_path = os.path.join(tmp, f"spec_{spec['role']}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(C.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1", "TMPDIR": tmp}  # the killed worker's temporary files go with ``tmp``
    log = open(log_path, "ab")
    log.write(f"\n===== recovery {spec['role']} {spec.get('label', '')} =====\n".encode())
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.recovery", "--worker", spec_path], cwd=C.REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, spec_path


def _last_progress(path: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line torn by the kill
    return None


def _all_progress(path: str) -> list[dict]:
    out = []
    try:
        with open(path, "rb") as f:
            for line in f.read().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


def _kill_at(spec: dict, log_path: Path, tmp: str, kill_at: int, timeout: float) -> tuple[dict, float]:
    """Launch the training worker, SIGKILL its process group once it reports step ``kill_at``: (last progress, time)."""
    proc, _ = _launch(spec, log_path, tmp)
    deadline = time.time() + timeout
    while True:
        last = _last_progress(spec["progress"])
        if last is not None and last["step"] >= kill_at:
            break
        if proc.poll() is not None:
            raise RuntimeError(f"training worker exited early (rc={proc.returncode}):\n{C.tail(log_path)}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"training worker did not reach step {kill_at} in {timeout}s")
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer, its ranks and DCP's writer processes
    t_kill = time.time()
    proc.wait()
    time.sleep(0.2)
    return _last_progress(spec["progress"]) or last, t_kill


class Storage:
    """Where the durable tier's checkpoints go: a directory on disk (page cache evicted before each resume) or
    moto's S3 server in its own process (``--storage s3``)."""

    def __init__(self, kind: str, base: str) -> None:
        self.kind, self.base = kind, base
        self.server: Optional[C.MotoS3] = C.MotoS3() if kind == "s3" else None
        self.options: dict = self.server.options if self.server else {}

    def root(self, name: str) -> str:
        if self.server is not None:
            return self.server.url(os.path.basename(self.base.rstrip("/")), name)
        path = os.path.join(self.base, name)
        os.makedirs(path, exist_ok=True)
        return path

    def records(self, root: str) -> list:
        from ckpt_core import list_records

        return list_records(root, self.options)

    def evict(self, root: str) -> int:
        return C.evict_page_cache(root) if self.server is None else 0

    def files(self, path: str) -> tuple[Any, list[str]]:
        from ckpt_core.storage import get_fs

        fs, fs_path = get_fs(path, **self.options)
        fs.invalidate_cache()
        return fs, sorted(fs.find(fs_path))

    def cold_read(self, path: str, chunk: int = 64 << 20) -> tuple:
        """Bytes and seconds of one sequential read of every file of checkpoint ``path`` (see ``cold_read``);
        on S3, each object read front to back through s3fs in ``chunk``-byte ranges."""
        if self.server is None:
            return cold_read(path, chunk)
        fs, names = self.files(path)
        total = 0
        t0 = time.perf_counter()
        for name in names:
            with fs.open(name, "rb", block_size=chunk, cache_type="none") as f:
                while data := f.read(chunk):
                    total += len(data)
        return total, time.perf_counter() - t0

    def remove(self, root: str) -> None:
        if self.server is None:
            C.rmtree(root)
            return
        from ckpt_core.storage import get_fs

        fs, fs_path = get_fs(root, **self.options)
        try:
            fs.rm(fs_path, recursive=True)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def local_holdings(local_dir: str) -> dict[int, set[int]]:
    """Step -> owners of the committed local snapshots under ``local_dir`` (every node's directory)."""
    out: dict[int, set[int]] = {}
    for rec in Path(local_dir).glob("node*/job-*/rank_*/step_*.json"):
        try:
            out.setdefault(int(rec.stem.split("_")[1]), set()).add(int(rec.parent.name.split("_")[1]))
        except ValueError:
            continue
    return out


def newest_complete(local_dir: str, world: int) -> Optional[int]:
    steps = [s for s, owners in local_holdings(local_dir).items() if len(owners) == world]
    return max(steps) if steps else None


def local_read(local_dir: str, step: int, world: int, node_size: int, chunk: int = 64 << 20) -> tuple[int, float]:
    """Bytes and seconds of one sequential read of the restored snapshot's data from node memory: each owner's
    slot file on its own node, up to the bytes its record names, in ``chunk``-byte reads into one buffer."""
    buf = memoryview(bytearray(chunk))
    total = 0
    t0 = time.perf_counter()
    for owner in range(world):
        for rec_path in Path(local_dir).glob(f"node{owner // node_size}/job-*/rank_{owner}/step_{step}.json"):
            rec = json.loads(rec_path.read_bytes())
            left = rec["data_bytes"]
            with open(rec_path.parent / f"slot_{rec['slot']}.data", "rb", buffering=0) as f:
                while left > 0 and (n := f.readinto(buf[:min(chunk, left)])):
                    total += n
                    left -= n
    return total, time.perf_counter() - t0


def training_figures(lines: list[dict], every: int, local_bytes: int, factor: int) -> dict:
    """Step times against the baseline steps of the same process, the stalls and the local tier's background.

    ``overhead``: the mean step (compute + ``maybe_save``) over the mean baseline step, minus 1. ``stall_s``: the
    local snapshot's stall (``LocalTier.last_stall_s``) once its slots' pages are faulted in (from the
    ``keep + 2``-th snapshot on), against a warm ``copy_`` of the same tensors in the same process.
    ``save_call_s``: the ``maybe_save`` call on the steps a durable save is due, from the second on (the first
    also starts the writer). ``busy``/``quiet`` steps: the
    other steps, with the local tier's background work (seal, replication) running at their start or not.
    """
    head = next((x for x in lines if "baseline" in x), None)
    steps = [x for x in lines if x.get("step", 0) >= 1 and "dt" in x]
    base = head["baseline"][WARMUP_STEPS:] if head else []
    base_s = (sum(base) / len(base)) if base else None
    train_s = (sum(x["dt"] for x in steps) / len(steps)) if steps else None
    copy_s = head.get("copy_s") if head else None
    stalls = [x["stall"] for x in steps if "stall" in x]
    steady = C.median(stalls[2:] or stalls)
    saves = [x["save_call_s"] for x in steps if x["step"] % every == 0]  # the first one also starts the writer
    bg = [b for x in steps for b in x.get("background", [])]
    rep = [b["replicate_s"] for b in bg if b["replicate_s"] > 0]
    other = [x for x in steps if "stall" not in x and x["step"] % every]
    busy = [x["dt"] for x in other if x.get("busy")]
    quiet = [x["dt"] for x in other if not x.get("busy")]

    def over(xs: list) -> Optional[float]:
        return None if not xs or not base_s else sum(xs) / len(xs) / base_s - 1

    writes = [(x["write_s"], x["write_bytes"]) for x in steps if x.get("write_s")]
    return {
        "baseline_step_s": base_s, "train_step_s": train_s, "steps": len(steps),
        "durable_write_s": C.median([w for w, _ in writes]),
        "durable_write_gbps": C.median([b / 1e9 / w for w, b in writes if b]),  # the checkpoint's bytes, all ranks
        "overhead": None if not base_s or train_s is None else train_s / base_s - 1,
        "save_call_s": C.median(saves[1:] or saves),
        "copy_s": copy_s, "snapshots": len(stalls), "stall_first_s": stalls[0] if stalls else None,
        "stall_s": steady, "stall_over_copy": C.ratio(steady, copy_s),
        "seal_s": C.median([b["seal_s"] for b in bg]), "replicate_s": C.median(rep),
        # a replication round sends this rank's snapshot to each replica and receives as many: bytes both ways
        "replicate_gbps": C.ratio(2 * (factor - 1) * local_bytes / 1e9 if rep else None, C.median(rep)),
        "busy_steps": len(busy), "busy_overhead": over(busy), "quiet_steps": len(quiet), "quiet_overhead": over(quiet),
    }


def run_variant(args: argparse.Namespace, base: dict, i: int, tier: str, kill_at: int, storage: Storage,
                log_path: Path) -> dict:
    """One kill/resume cycle of one variant (``durable``: the durable tier alone; ``local``: both tiers)."""
    ranks = base["ranks"]
    name = f"cycle{i:02d}-{tier}"
    root = storage.root(name)
    local = None
    if tier == "local":
        node_size = 1
        local = {"every": args.local_every, "dir": os.path.join(args.local_base, name), "node_size": node_size,
                 "factor": 2 if ranks // node_size >= 2 else 1}
        os.makedirs(local["dir"], mode=0o700)
    run_id = f"bench-recovery-{args.stamp}-{name}"  # the relaunch is the same job: it finds its snapshots
    every = args.local_durable_every if tier == "local" else args.every
    common = {**base, "every": every, "root": root, "storage_options": storage.options, "local": local,
              "run_id": run_id}
    try:
        with tempfile.TemporaryDirectory(prefix="ckpt-bench-rec-") as tmp:
            progress = os.path.join(tmp, "progress.jsonl")
            spec = {**common, "role": "train", "progress": progress, "max_steps": 10 * args.every + kill_at,
                    "label": f"cycle {i} {tier} (kill at step {kill_at})"}
            last, t_kill = _kill_at(spec, log_path, tmp, kill_at, args.timeout)
            lines = _all_progress(progress)
            records = storage.records(root)
            committed = [r.step for r in records if r.committed]
            torn = [r.step for r in records if not r.committed]
            newest_durable = max(committed) if committed else None
            newest_local = newest_complete(local["dir"], ranks) if local else None
            newest = max([s for s in (newest_durable, newest_local) if s is not None], default=None)
            evicted = 0 if args.warm else storage.evict(root)
            spec = {**common, "role": "resume", "label": f"cycle {i} {tier}"}
            t_launch = time.time()
            gathered = C.run_worker("recovery", spec, args.timeout, log_path)
            r0 = gathered[0]
            restored = r0["restored_step"]
            from_local = all(g["from_local"] for g in gathered)
            if from_local:
                read = local_read(local["dir"], restored, ranks, local["node_size"])
            else:
                read = next((storage.cold_read(r.path) for r in storage.records(root) if r.step == restored),
                            (0, None))
    finally:
        storage.remove(root)
        if local:
            C.rmtree(local["dir"])
    m = r0["marks"]
    slowest = max(gathered, key=lambda g: g["restore_s"])  # its phases add up to the restore's time
    tim = {k: slowest["timings"].get(k, 0.0) for k in ("discover", "load", "apply", "verify")}
    restore_s = slowest["restore_s"]
    phases = {
        "interpreter": m["t_worker"] - t_launch,
        "imports": m["t_imports"] - m["t_worker"],
        "process_group": m["t_pg"] - m["t_imports"],
        "build_model": m["t_model"] - m["t_pg"],
        "manager": m["t_manager"] - m["t_model"],
        **tim,
        "restore_other": restore_s - sum(tim.values()),
        "first_step": m["t_first_step"] - m["t_restored"],
    }
    steps = [x for x in lines if x.get("step", 0) >= 1 and "t" in x]
    t_restored = next((x["t"] for x in steps if x["step"] == restored), None) if restored else None
    if t_restored is None and steps:
        t_restored = steps[0]["t"] - steps[0]["dt"]  # nothing restored: every step since the first is lost
    lost = last["step"] - (restored or 0)
    local_bytes = max(g["local_bytes"] for g in gathered)
    return {
        "cycle": i, "tier": tier, "kill_at": kill_at, "last_step": last["step"],
        "trainer_knew_committed": last.get("committed"), "committed": committed, "torn": torn,
        "newest_durable": newest_durable, "newest_local": newest_local, "restored_step": restored,
        "restored_from": "local" if from_local else "durable", "lost_steps": lost,
        "lost_s": None if t_restored is None else last["t"] - t_restored, "evicted_bytes": evicted,
        "restore_s": restore_s, "time_to_first_step_s": m["t_first_step"] - t_launch, "phases": phases,
        "restored_ok": restored == newest, "t_kill": t_kill, "local_timings": r0.get("local_timings"),
        "restore_rss_ratio": max(g["rss"]["rss_ratio"] for g in gathered),
        "restore_rss_added": max(g["rss"]["peak_rss_added"] for g in gathered),
        "restore_only_ratio": max(g["rss"]["added_after_ratio"] for g in gathered),
        "local_bytes": local_bytes,
        **training_figures(lines, every, local_bytes, local["factor"] if local else 1),
        **limits(gathered, tim, read),
    }


def limits(gathered: list, tim: dict, read: tuple) -> dict:
    """The cycle's figures beside the limits: the cold read of the restored files (bytes, seconds, and on disk
    the buffered, the direct and the fresh-buffer direct read's seconds), the load against the cold read and
    against the fresh-buffer read, the verify against the load, and the fingerprints' part of the verify
    (worst rank)."""
    read_bytes, read_s, *kinds = read
    return {"fingerprint_s": max(g["timings"].get("fingerprint", 0.0) for g in gathered),
            "cold_read_bytes": read_bytes, "cold_read_s": read_s, **(kinds[0] if kinds else {}),
            "load_vs_read": C.ratio(read_s, tim["load"]),
            "load_vs_fresh": C.ratio(kinds[0].get("fresh_s") if kinds else None, tim["load"]),
            "verify_vs_load": C.ratio(tim["verify"], tim["load"])}


def cold_read(path: str, chunk: int = 64 << 20) -> tuple[int, float, dict]:
    """Bytes and seconds of a cold sequential read of every file of checkpoint ``path``: the faster of a
    buffered read and a direct one (``cold_reads``; both in the dict, with the direct read into fresh
    buffers), so the limit is what the disk gives at best."""
    total, buffered, direct, fresh = cold_reads(path, chunk)
    best = min(t for t in (buffered, direct) if t is not None)
    return total, best, {"buffered_s": buffered, "direct_s": direct, "fresh_s": fresh}


def cold_reads(path: str, chunk: int = 64 << 20) -> tuple[int, float, Optional[float], Optional[float]]:
    """Bytes, and seconds of three cold sequential reads of every file of checkpoint ``path``: buffered,
    with ``O_DIRECT``, and with ``O_DIRECT`` into freshly allocated buffers (each None where the file
    system refuses ``O_DIRECT``).

    Each time the files are evicted from the page cache first, then read front
    to back, one after the other, in ``chunk``-byte reads. The first two read
    into one reused buffer (page-aligned for the direct read), so they touch
    no new memory. The buffered read takes a page-cache page per 4 KiB: on a
    VM that returns free memory to its hypervisor, pages that were free a
    while cost a first touch there, so it is fast right after something else
    freed memory and slow otherwise; the reused direct read does not depend on
    it. The third reads each file into a fresh page-aligned buffer of its
    size, all held to the end, as a restore loads into fresh tensors: it pays
    the first touch of those pages, the floor of a load on such a machine. As
    in a restore, the files are read side by side (a thread per file, up to
    the load's ``READ_THREADS``) while the process holds resident memory of
    the checkpoint's size (the live state a resuming process has built):
    fresh pages cost more when that memory is taken.
    """
    names = [os.path.join(path, name) for name in sorted(os.listdir(path))]
    C.evict_page_cache(path)
    buf = memoryview(bytearray(chunk))
    total = 0
    t0 = time.perf_counter()
    for name in names:
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    buffered = time.perf_counter() - t0
    reused = mmap.mmap(-1, chunk)
    try:
        direct = _direct_read(path, names, lambda size: reused, chunk)
    finally:
        reused.close()
    held: list = []

    def fresh(size: int) -> mmap.mmap:
        held.append(mmap.mmap(-1, max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)))
        return held[-1]

    if direct is None:
        return total, buffered, None, None
    live = _resident(total)
    try:
        into_fresh = _direct_read(path, names, fresh, chunk, _fresh_threads(names))
    finally:
        live.close()
        for m in held:
            m.close()
    return total, buffered, direct, into_fresh


def _direct_read(path: str, names: list[str], buffer_for: Any, chunk: int = 64 << 20,
                 threads: int = 1) -> Optional[float]:
    """Seconds of one cold ``O_DIRECT`` read of ``names`` (the files of ``path``, evicted first), each file
    front to back in ``chunk``-byte reads into ``buffer_for(file size)``: a reused buffer of ``chunk``
    bytes, or a fresh one of the file's size; on ``threads`` threads, a file each at a time. None where the
    file system refuses ``O_DIRECT``."""
    def read(name: str) -> None:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            size = os.fstat(fd).st_size
            view, pos = memoryview(buffer_for(size)), 0
            while pos < size and (n := os.preadv(fd, [view[pos % len(view):][:chunk]], pos)):
                pos += n
        finally:
            os.close(fd)

    C.evict_page_cache(path)
    t0 = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(read, names))
    except OSError:
        return None
    return time.perf_counter() - t0


def _fresh_threads(names: list[str]) -> int:
    """Threads of the fresh-buffer read: a file each, up to the load's ``READ_THREADS``."""
    from ckpt_core.inplace_read import READ_THREADS

    return max(1, min(READ_THREADS, len(names)))


def _resident(nbytes: int) -> mmap.mmap:
    """``nbytes`` (at least a page) of anonymous memory with every page touched, as a live state is."""
    import numpy as np

    live = mmap.mmap(-1, max(mmap.PAGESIZE, nbytes))
    np.frombuffer(live, dtype=np.uint8)[:: mmap.PAGESIZE] = 1
    return live


def calibrate(threads: int, n: int, step_s: float) -> dict:
    import torch

    torch.set_num_threads(threads)
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b, out=c)
        times.append((time.perf_counter() - t0) / 10)
    return {"matmul_n": n, "matmuls_per_step": max(1, round(step_s / min(times)))}


FIGURES = ("overhead", "baseline_step_s", "train_step_s", "save_call_s", "durable_write_s", "durable_write_gbps", "copy_s", "stall_first_s", "stall_s",
           "stall_over_copy", "seal_s", "replicate_s", "replicate_gbps", "busy_overhead", "quiet_overhead",
           "restore_rss_ratio", "restore_rss_added", "restore_only_ratio", "fingerprint_s", "cold_read_bytes", "cold_read_s", "buffered_s",
           "direct_s", "fresh_s", "load_vs_read", "load_vs_fresh", "verify_vs_load")


def summarize(cycles: list, args: argparse.Namespace) -> dict:
    """Medians over the cycles of one variant."""
    ok = [c for c in cycles if "error" not in c]
    lost = [c["lost_steps"] for c in ok]
    return {
        "n": len(ok),
        "time_to_first_step_s": C.median([c["time_to_first_step_s"] for c in ok]),
        "restore_s": C.median([c["restore_s"] for c in ok]),
        "phases": {p: C.median([c["phases"][p] for c in ok]) for p in PHASES},
        "lost_steps_median": C.median(lost),
        "lost_steps_mean": (sum(lost) / len(lost)) if lost else None,
        "lost_steps_max": max(lost) if lost else None,
        "lost_s_median": C.median([c["lost_s"] for c in ok]),
        "restored_from_local": sum(c["restored_from"] == "local" for c in ok),
        "all_restored_newest": all(c["restored_ok"] for c in ok),
        "torn_seen": sum(len(c["torn"]) for c in ok),
        **{k: C.median([c.get(k) for c in ok]) for k in FIGURES},
        "busy_steps": sum(c.get("busy_steps") or 0 for c in ok),
        "snapshots": sum(c.get("snapshots") or 0 for c in ok),
        "read_goals": read_goals(ok),
    }


def read_goals(cycles: list) -> list[dict]:
    """The read path's goals over the cycles, each a ratio of totals with its bootstrap 95 % CI: the cold read's
    time over the load's (at least 0.8x) and the verify's over the load's (at most 15 %)."""
    import numpy as np

    goals = []
    for goal, pairs, limit, higher in (
            ("load >= 0.8x a cold sequential read of the same bytes (read time / load time)",
             [(c.get("cold_read_s"), c["phases"]["load"]) for c in cycles], 0.8, True),
            ("verify <= 15 % of the load (verify time / load time)",
             [(c["phases"]["verify"], c["phases"]["load"]) for c in cycles], 0.15, False)):
        rows = [r for r in pairs if None not in r]
        ci = C.bootstrap_ci(rows, C.ratio_of_sums) if rows else None
        value = C.ratio_of_sums(np.asarray(rows, dtype=float)) if rows else None
        goals.append({"goal": goal, "value": value, "ci": None if ci is None else list(ci), "limit": limit,
                      "n": len(rows), "status": C.goal_status(ci, limit, higher_is_better=higher)})
    return goals


def compare(cycles: list, args: argparse.Namespace) -> tuple[dict, list]:
    """The local tier against the durable tier, paired by cycle (same kill step, run back to back): ratios of
    totals over the cycles with bootstrap 95 % CIs, and the goals."""
    pairs = [(c["variants"]["local"], c["variants"]["durable"]) for c in cycles
             if all(t in c.get("variants", {}) and "error" not in c["variants"][t] for t in TIERS)]

    def est(rows: list, stat: Any) -> dict:
        rows = [r for r in rows if None not in r]
        if not rows:
            return {"value": None, "ci": None, "n": 0}
        import numpy as np

        ci = C.bootstrap_ci(rows, stat)
        return {"value": float(stat(np.asarray(rows, dtype=float))), "ci": None if ci is None else list(ci),
                "n": len(rows)}

    def mean0(a: Any) -> float:
        return float(a[:, 0].mean())

    ratios = {k: est([(loc[k], dur[k]) for loc, dur in pairs], C.ratio_of_sums)
              for k in ("restore_s", "time_to_first_step_s", "lost_s", "lost_steps")}
    over = est([(loc["overhead"] - dur["overhead"],) for loc, dur in pairs
                if loc.get("overhead") is not None and dur.get("overhead") is not None], mean0)
    out = {"n": len(pairs), **{f"{k}_ratio": v for k, v in ratios.items()}, "overhead_difference": over}
    goals = []

    def add(goal: str, e: dict, limit: float, unit: str, note: str = "") -> None:
        status = C.goal_status(e["ci"], limit) if not note else "n/a"
        goals.append({"goal": goal, "value": e["value"], "ci": e["ci"], "limit": limit, "unit": unit,
                      "status": status, "note": note})

    add("recovery from the local tier <= 0.5x the durable tier's restore time", ratios["restore_s"], 0.5, "x",
        "" if args.storage == "s3" else "the goal is set with the durable tier on S3 (--storage s3)")
    add("work lost per failure (s) <= 1/5 of the durable tier's", ratios["lost_s"], 0.2, "x")
    add(f"at the same training overhead (local + durable minus durable only <= {100 * args.overhead_tolerance:.0f} "
        "points)", over, args.overhead_tolerance, "%")
    return out, goals


def print_summary(s: dict, args: argparse.Namespace, ranks: int, tier: str) -> None:
    every = (f"save every {args.local_durable_every} steps, snapshot every {args.local_every}" if tier == "local"
             else f"save every {args.every} steps")
    print(f"\n-- recovery, {LABELS[tier]}, {ranks} rank(s), state {args.size_bytes / C.GiB:.3g} GiB, durable tier on "
          f"{args.storage}, {every} (step ~{C.fmt(s['baseline_step_s'], '.2f')}s), {s['n']} cycles, page cache "
          f"{'warm' if args.warm else 'evicted'} --")
    print(f"time from launch to the first resumed step: {C.fmt(s['time_to_first_step_s'], '.2f')}s "
          f"(restore {C.fmt(s['restore_s'], '.2f')}s = {C.fmt(C.ratio(args.size_bytes / 1e9, s['restore_s']), '.2f')} "
          f"GB/s; from the local tier in {s['restored_from_local']} of {s['n']} cycles)")
    total = s["time_to_first_step_s"] or 0
    for p in PHASES:
        v = s["phases"][p]
        print(f"  {p:<14}{C.fmt(v, '.3f'):>8}s {C.fmt(None if not total or v is None else 100 * v / total, '.0f'):>4}%")
    print_limits(s)
    cadence = args.local_every if tier == "local" else args.every
    print(f"work lost per failure: median {C.fmt(s['lost_steps_median'], '.0f')} steps "
          f"({C.fmt(s['lost_s_median'], '.1f')}s), mean {C.fmt(s['lost_steps_mean'], '.1f')}, max {s['lost_steps_max']} "
          f"(every {cadence}: a kill at a uniformly random step loses ~{cadence / 2:.1f} + the commit lag)")
    print(f"training: {C.fmt(s['train_step_s'], '.3f')}s per step against {C.fmt(s['baseline_step_s'], '.3f')}s without "
          f"checkpoints in the same process: overhead {C.fmt(None if s['overhead'] is None else 100 * s['overhead'], '+.1f')}%"
          f"; maybe_save on the durable save steps {C.fmt(s['save_call_s'], '.3f')}s; a durable save writes in "
          f"{C.fmt(s['durable_write_s'], '.1f')}s ({C.fmt(s['durable_write_gbps'], '.3f')} GB/s, all ranks)")
    if tier == "local":
        print(f"snapshot stall {C.fmt(s['stall_s'], '.3f')}s (first {C.fmt(s['stall_first_s'], '.3f')}s) = "
              f"{C.fmt(s['stall_over_copy'], '.2f')}x a warm copy_ of the same bytes ({C.fmt(s['copy_s'], '.3f')}s); "
              f"background per snapshot: seal {C.fmt(s['seal_s'], '.3f')}s, replication {C.fmt(s['replicate_s'], '.3f')}s"
              f" ({C.fmt(s['replicate_gbps'], '.2f')} GB/s both ways)")
        print(f"steps with the background running: {C.fmt(None if s['busy_overhead'] is None else 100 * s['busy_overhead'], '+.1f')}% "
              f"over the baseline ({s['busy_steps']} steps), the other steps "
              f"{C.fmt(None if s['quiet_overhead'] is None else 100 * s['quiet_overhead'], '+.1f')}%")
    print(f"restore memory: building the state and restoring it added {C.fmt(C.ratio(s['restore_rss_added'], C.MiB), '.0f')} MiB "
          f"of RSS per rank = {C.fmt(s['restore_rss_ratio'], '.2f')}x the rank's state, the restore alone "
          f"{C.fmt(s['restore_only_ratio'], '.2f')}x (medians; floors "
          f"{'1.0 and 0: loaded in place' if args.load == 'in_place' and tier == 'durable' else '2.0 and 1.0: loaded into fresh buffers'})")
    print(f"restored the newest committed checkpoint or snapshot every time: {s['all_restored_newest']}; "
          f"torn (uncommitted) step directories seen and skipped: {s['torn_seen']}")


def print_limits(s: dict) -> None:
    """The load against a cold sequential read of the same bytes, and the verify against the load (medians)."""
    load, verify, read_s = s["phases"]["load"], s["phases"]["verify"], s["cold_read_s"]
    print(f"load {C.fmt(load, '.3f')}s against a cold sequential read (the faster of buffered and direct) of the same "
          f"{C.fmt(C.ratio(s['cold_read_bytes'], 1e6), '.0f')} MB in {C.fmt(read_s, '.3f')}s "
          f"({C.fmt(C.ratio(C.ratio(s['cold_read_bytes'], 1e9), read_s), '.2f')} GB/s): the load runs at "
          f"{C.fmt(s['load_vs_read'], '.2f')}x the read (goal >= 0.80x)")
    if s.get("buffered_s") is not None:
        print(f"  the cold reads: buffered {C.fmt(s['buffered_s'], '.3f')}s, direct {C.fmt(s.get('direct_s'), '.3f')}s")
    if s.get("fresh_s") is not None:
        print(f"  a second limit, the direct read into fresh buffers of the files' sizes, a thread per file, beside "
              f"resident memory of the same size (the first touch of the pages a restore loads into, while the "
              f"live state is held): {C.fmt(s['fresh_s'], '.3f')}s; the load runs at "
              f"{C.fmt(s.get('load_vs_fresh'), '.2f')}x it")
    print(f"verify {C.fmt(verify, '.3f')}s = {C.fmt(None if s['verify_vs_load'] is None else 100 * s['verify_vs_load'], '.0f')}% "
          f"of the load (goal <= 15%); fingerprints {C.fmt(s['fingerprint_s'], '.3f')}s of it")
    for g in s.get("read_goals", []):
        print(f"goal: {g['goal']}: {C.fmt(g['value'], '.3f')} {fmt_ci(g['ci'], '.3f')} over {g['n']} cycles: "
              f"{g['status']}")


def fmt_ci(ci: Optional[list], spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if ci is None else f"[{format(scale * ci[0], spec)}, {format(scale * ci[1], spec)}]"


def print_comparison(suite: dict, args: argparse.Namespace) -> None:
    s, cmp = suite["summary"], suite["comparison"]
    d, loc = s["durable"], s["local"]
    print(f"\n-- local tier against the durable tier ({args.storage}), {suite['ranks']} rank(s), "
          f"{args.size_bytes / C.GiB:.3g} GiB, durable every {args.every} steps (with the local tier: every "
          f"{args.local_durable_every}), local every {args.local_every}, "
          f"{cmp['n']} paired cycles (same kill steps) --")

    def pct(x: Optional[float]) -> str:
        return C.fmt(None if x is None else 100 * x, "+.1f") + "%"

    rows = [("launch to first resumed step (s)", "time_to_first_step_s", ".2f"), ("restore (s)", "restore_s", ".2f"),
            ("work lost (steps, median)", "lost_steps_median", ".0f"), ("work lost (s, median)", "lost_s_median", ".1f")]
    print(f"  {'':<36}{'durable only':>14}{'local + durable':>17}   local / durable [95% CI]")
    keys = {"time_to_first_step_s": "time_to_first_step_s", "restore_s": "restore_s",
            "lost_steps_median": "lost_steps", "lost_s_median": "lost_s"}
    for label, k, spec in rows:
        r = cmp[f"{keys[k]}_ratio"]
        print(f"  {label:<36}{C.fmt(d[k], spec):>14}{C.fmt(loc[k], spec):>17}   "
              f"{C.fmt(r['value'], '.2f')} {fmt_ci(r['ci'])}")
    o = cmp["overhead_difference"]
    print(f"  {'training overhead (median)':<36}{pct(d['overhead']):>14}{pct(loc['overhead']):>17}"
          f"   difference {pct(o['value'])} {fmt_ci(o['ci'], '+.1f', 100)}")
    print(f"  {'stall / warm copy_ (median)':<36}{C.fmt(C.ratio(d['save_call_s'], d['copy_s']), '.2f'):>14}"
          f"{C.fmt(loc['stall_over_copy'], '.2f'):>17}   (durable: maybe_save on a save step; local: the snapshot)")
    print("goals (PASS = the whole 95% CI meets the goal, MISS = the whole CI misses it, OPEN = the CI straddles it; "
          "reported, not asserted):")
    for g in suite["goals"]:
        scale, spec = (100, "+.1f") if g["unit"] == "%" else (1, ".2f")
        value = C.fmt(None if g["value"] is None else scale * g["value"], spec) + ("%" if g["unit"] == "%" else "x")
        print(f"  [{g['status']:>4}] {g['goal']:<84} {value} CI {fmt_ci(g['ci'], spec, scale)}"
              + (f"  ({g['note']})" if g["note"] else ""))


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--size-gib", type=float, default=None, help="state size in GiB (default 1; --quick: 1/16)")
    p.add_argument("--tensor-mib", type=float, default=None, help="size of one tensor in MiB (default 64; --quick: 8)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=None, help="kill/resume cycles (default 5; --quick: 2)")
    p.add_argument("--every", type=int, default=None, help="durable save every N steps (default 20; --quick: 10)")
    p.add_argument("--tiers", default="durable,local",
                   help="variants run in every cycle, interleaved, with the same kill step: durable (the durable tier "
                        "alone), local (local tier + durable tier); default both")
    p.add_argument("--local-every", type=int, default=None,
                   help="local tier: snapshot every N steps (default: --every / 5)")
    p.add_argument("--local-durable-every", type=int, default=None,
                   help="the local variant's durable save every N steps (default: --every); a sparser durable "
                        "cadence compares the two variants at the same training overhead")
    p.add_argument("--local-dir", default="/dev/shm",
                   help="where the local tier's fresh temporary directory goes (default /dev/shm: node memory)")
    p.add_argument("--storage", default="disk", choices=("disk", "s3"),
                   help="the durable tier: a directory on disk (--dir), or moto's S3 server started for the run")
    p.add_argument("--overhead-tolerance", type=float, default=0.01,
                   help="'the same training overhead': local + durable at most this much above durable only "
                        "(default 0.01 = 1 point)")
    p.add_argument("--baseline-steps", type=int, default=12,
                   help="steps without checkpoints at the start of every training process (the first "
                        f"{WARMUP_STEPS} left out): the overhead's reference")
    p.add_argument("--step-s", type=float, default=None, help="toy training step in seconds (default 0.5; --quick: 0.05)")
    p.add_argument("--async-mode", default="process", choices=("process", "thread", "off"))
    p.add_argument("--writer-threads", type=int, default=1)
    p.add_argument("--matmul-n", type=int, default=512)
    p.add_argument("--load", default="in_place", choices=("in_place", "fresh"),
                   help="a durable restore loads into the live tensors (restore_in_place, the default) or into fresh "
                        "buffers (restore_in_place=False)")
    p.add_argument("--warm", action="store_true", help="keep the checkpoint in the page cache for the resume")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill steps")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    q = a.quick
    a.size_bytes = int((a.size_gib if a.size_gib is not None else (1 / 16 if q else 1.0)) * C.GiB)
    a.tensor_bytes = int((a.tensor_mib if a.tensor_mib is not None else (8 if q else 64)) * C.MiB)
    a.repeats = a.repeats if a.repeats is not None else (2 if q else 5)
    a.every = a.every if a.every is not None else (10 if q else 20)
    a.local_every = a.local_every if a.local_every is not None else max(1, a.every // 5)
    a.local_durable_every = a.local_durable_every or a.every
    a.step_s = a.step_s if a.step_s is not None else (0.05 if q else 0.5)
    a.tiers = [t.strip() for t in a.tiers.split(",") if t.strip()]
    bad = [t for t in a.tiers if t not in TIERS]
    if bad or not a.tiers:
        p.error(f"--tiers takes durable, local or both (comma-separated), got {','.join(bad) or a.tiers}")
    return a


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    C.exit_on_sigterm()
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-recovery-")
    args.stamp = stamp = C.timestamp()
    args.local_base = tempfile.mkdtemp(prefix="ckpt-bench-local-", dir=args.local_dir) if "local" in args.tiers else None
    log_path = C.RESULTS_DIR / f"recovery_{stamp}.log"
    C.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t0 = time.time()
    suites = []
    failures = 0
    storage = None
    try:
        storage = Storage(args.storage, args.dir)
        where = storage.root("") if args.storage == "s3" else args.dir
        print(f"durable checkpoints under {where}; local snapshots under {args.local_base}; worker logs in {log_path}",
              flush=True)
        for ranks in args.ranks:
            threads = max(1, (os.cpu_count() or 1) // ranks)
            cal = calibrate(threads, args.matmul_n, args.step_s)
            base = {"ranks": ranks, "threads": threads, "size_bytes": args.size_bytes,
                    "tensor_bytes": args.tensor_bytes, "every": args.every, "async_mode": args.async_mode,
                    "writer_threads": args.writer_threads, "baseline_steps": args.baseline_steps,
                    "restore_in_place": args.load == "in_place", **cal}
            cycles = []
            for i in range(args.repeats):
                kill_at = rng.randrange(2 * args.every, 5 * args.every)
                order = args.tiers if i % 2 == 0 else args.tiers[::-1]  # interleaved: each variant goes first in turn
                cycle: dict = {"cycle": i, "kill_at": kill_at, "order": order, "variants": {}}
                for tier in order:
                    try:
                        c = run_variant(args, base, i, tier, kill_at, storage, log_path)
                        print(f"  cycle {i + 1}/{args.repeats} {LABELS[tier]}: killed after step {c['last_step']}, "
                              f"newest durable {c['newest_durable']}, local {c['newest_local']}; resumed from "
                              f"{c['restored_step']} ({c['restored_from']}, lost {c['lost_steps']} steps = "
                              f"{C.fmt(c['lost_s'], '.1f')}s) in {c['time_to_first_step_s']:.2f}s, restore "
                              f"{c['restore_s']:.2f}s; overhead {C.fmt(None if c['overhead'] is None else 100 * c['overhead'], '+.1f')}%"
                              + (f", stall {C.fmt(c['stall_s'], '.3f')}s = {C.fmt(c['stall_over_copy'], '.2f')}x copy_"
                                 if tier == "local" else ""), flush=True)
                    except Exception as e:  # noqa: BLE001
                        failures += 1
                        c = {"cycle": i, "tier": tier, "error": str(e)}
                        print(f"  cycle {i + 1}/{args.repeats} {LABELS[tier]} failed: {str(e).splitlines()[0]}",
                              flush=True)
                    cycle["variants"][tier] = c
                cycles.append(cycle)
            summary = {t: summarize([c["variants"][t] for c in cycles], args) for t in args.tiers}
            suite = {"ranks": ranks, "calibration": cal, "cycles": cycles, "summary": summary}
            if len(args.tiers) == 2:
                suite["comparison"], suite["goals"] = compare(cycles, args)
            suites.append(suite)
    finally:
        if storage is not None:
            storage.close()
        if own_dir:
            C.rmtree(args.dir)
        if args.local_base:
            C.rmtree(args.local_base)
    for s in suites:
        for t in args.tiers:
            print_summary(s["summary"][t], args, s["ranks"], t)
        if "comparison" in s:
            print_comparison(s, args)
    payload = {"benchmark": "recovery", "timestamp": stamp, "wall_s": time.time() - t0, "machine": C.machine_info(),
               "config": {k: v for k, v in vars(args).items() if k != "worker"}, "phases": PHASES, "suites": suites}
    paths = C.save_json(f"recovery_{stamp}.json", payload, args.out)
    print(f"\nwrote {', '.join(map(str, paths))} in {time.time() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
