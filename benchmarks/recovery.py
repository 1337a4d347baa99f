"""Recovery benchmark: time from process start to the first resumed training step, and the work lost per failure.

    python -m benchmarks.recovery                 # 1 GiB state, 1 rank, 5 kill/resume cycles
    python -m benchmarks.recovery --ranks 2       # 2 ranks over gloo (state sharded)
    python -m benchmarks.recovery --quick         # 64 MiB, 2 cycles: a smoke run

Each cycle:

1. *train*: a fresh training run (toy matmul steps of ``--step-s``, a save
   every ``--every`` steps with ``CheckpointManager(async_mode=...)``,
   ``keep_last=2``) is killed with SIGKILL at a random step (uniform in
   ``[2, 5) * every``). The whole process group dies, DCP's writer process
   included, as on a node failure.
2. *work lost*: steps completed before the kill minus the newest committed
   checkpoint found on storage afterwards (and in seconds of training).
3. *resume*: the checkpoint files are evicted from the page cache
   (``posix_fadvise``, this benchmark's files only; ``--warm`` keeps them), then
   a fresh process restores and runs one training step. The time from launch to
   the end of that step is split into: interpreter + imports, process group,
   model construction, manager creation, and the manager's restore phases
   (``CheckpointManager.last_restore_timings``: discover = listing + choosing +
   validating, load = DCP load into fresh buffers, apply = set_state_dict etc.,
   verify = fingerprints), then the first step. The resume's host memory is
   measured too: ``restore_rss_ratio`` is the peak RSS that the process group,
   building the state and restoring it add above the RSS after imports
   (sampled every 2 ms, ``_common.RssMeter``), divided by the state's bytes on
   the rank (worst rank). The floor is 2.0: the live state plus the fresh
   buffers a restore loads into before anything is applied.
4. *limits*: right after the resume, the files of the restored checkpoint are
   evicted again and read once, front to back, one file after the other, in
   64 MiB reads into one reused buffer: the cold sequential read of the same
   bytes on the same disk, in the same run. The load is reported against it
   (its time divided by the load's: the goal is at least 0.8x) and the verify
   against the load (goal at most 15 %), with the fingerprints' part of the
   verify (``timings["fingerprint"]``).

Medians over the cycles; JSON in ``benchmarks/results/recovery_<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
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


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    marks = {"t_worker": spec["_t_worker"]}
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401

    from ckpt_core import CheckpointManager, TrainState

    C.import_lazy_modules(world)
    marks["t_imports"] = time.time()
    meter = C.RssMeter().start() if spec["role"] == "resume" else None  # baseline: the RSS after imports
    C.init_dist(rank, world, port)
    torch.set_num_threads(spec["threads"])
    marks["t_pg"] = time.time()
    model, _, local_bytes = C.build_model(spec["size_bytes"], spec["tensor_bytes"], rank, world, seed=1)
    marks["t_model"] = time.time()
    mgr = CheckpointManager(spec["root"], async_mode=spec["async_mode"], writer_threads=spec["writer_threads"],
                            every_n_steps=spec["every"], keep_last=2)
    state = TrainState(model=model)
    marks["t_manager"] = time.time()
    step_fn = _work(spec, rank, world)
    out: dict = {"rank": rank, "local_bytes": local_bytes}
    if spec["role"] == "resume":
        t0 = time.time()
        rec = mgr.restore(state)
        marks["t_restored"] = time.time()
        meter.stop()
        out["rss"] = meter.result(local_bytes)
        out["restore_s"] = marks["t_restored"] - t0
        out["timings"] = dict(getattr(mgr, "last_restore_timings", {}) or {})
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
    # role == "train": run until killed (or max_steps).
    progress = None
    if rank == 0:
        progress = os.open(spec["progress"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    step = 0
    while step < spec["max_steps"]:
        step += 1
        t0 = time.time()
        step_fn(model)
        mgr.maybe_save(step, state)
        if progress is not None:
            last = mgr.last_save_stats
            os.write(progress, json.dumps({"step": step, "t": time.time(), "dt": time.time() - t0,
                                           "committed": None if last is None else last.step}).encode() + b"\n")
    mgr.close()
    C.finish_rank(world)


def worker_main(spec_path: str) -> None:
    C.worker(spec_path, rank_main, _t_worker=T_IMPORT0)


# -------------------------------------------------------------- harness side
def _launch(spec: dict, log_path: Path, tmp: str) -> tuple[subprocess.Popen, str]:
    spec_path = os.path.join(tmp, f"spec_{spec['role']}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(C.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
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


def run_cycle(args: argparse.Namespace, base: dict, i: int, log_path: Path, rng: random.Random) -> dict:
    from ckpt_core import list_records

    root = os.path.join(args.dir, f"cycle{i:02d}")
    os.makedirs(root, exist_ok=True)
    kill_at = rng.randrange(2 * args.every, 5 * args.every)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-rec-") as tmp:
        progress = os.path.join(tmp, "progress.jsonl")
        spec = {**base, "role": "train", "root": root, "progress": progress, "max_steps": 10 * args.every + kill_at,
                "label": f"cycle {i} (kill at step {kill_at})"}
        last, t_kill = _kill_at(spec, log_path, tmp, kill_at, args.timeout)
        steps = _all_progress(progress)
        step_s = C.median([s["dt"] for s in steps[1:]])
        records = list_records(root)
        committed = [r.step for r in records if r.committed]
        torn = [r.step for r in records if not r.committed]
        newest = max(committed) if committed else 0
        lost = last["step"] - newest
        evicted = 0 if args.warm else C.evict_page_cache(root)
        # resume
        spec = {**base, "role": "resume", "root": root,
                "label": f"cycle {i}"}
        t_launch = time.time()
        gathered = C.run_worker("recovery", spec, args.timeout, log_path)
        read = [cold_read(r.path) for r in list_records(root) if r.step == gathered[0]["restored_step"]]
    C.rmtree(root)
    r0 = gathered[0]
    m = r0["marks"]
    tim = {k: max(g["timings"].get(k, 0.0) for g in gathered) for k in ("discover", "load", "apply", "verify")}
    restore_s = max(g["restore_s"] for g in gathered)
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
    return {
        "cycle": i, "kill_at": kill_at, "last_step": last["step"], "trainer_knew_committed": last.get("committed"),
        "committed": committed, "torn": torn, "restored_step": r0["restored_step"], "lost_steps": lost,
        "step_s": step_s, "lost_s": None if step_s is None else lost * step_s, "evicted_bytes": evicted,
        "restore_s": restore_s, "time_to_first_step_s": m["t_first_step"] - t_launch, "phases": phases,
        "restored_ok": r0["restored_step"] == newest, "t_kill": t_kill,
        "restore_rss_ratio": max(g["rss"]["rss_ratio"] for g in gathered),
        "restore_rss_added": max(g["rss"]["peak_rss_added"] for g in gathered),
        **limits(gathered, tim, read[0] if read else (0, None)),
    }


def limits(gathered: list, tim: dict, read: tuple[int, Optional[float]]) -> dict:
    """The cycle's figures beside the limits: the cold read of the restored files (bytes, seconds), the load
    against it, the verify against the load, and the fingerprints' part of the verify (worst rank)."""
    read_bytes, read_s = read
    return {"fingerprint_s": max(g["timings"].get("fingerprint", 0.0) for g in gathered),
            "cold_read_bytes": read_bytes, "cold_read_s": read_s,
            "load_vs_read": C.ratio(read_s, tim["load"]), "verify_vs_load": C.ratio(tim["verify"], tim["load"])}


def cold_read(path: str, chunk: int = 64 << 20) -> tuple[int, float]:
    """Bytes and seconds of a cold sequential read of every file of checkpoint ``path``.

    The files are evicted from the page cache first, then read front to back,
    one after the other, in ``chunk``-byte reads into one reused buffer: what
    the disk gives a plain reader, for the same bytes the restore read.
    """
    C.evict_page_cache(path)
    buf = memoryview(bytearray(chunk))
    total = 0
    t0 = time.perf_counter()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - t0


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


def summarize(cycles: list, args: argparse.Namespace) -> dict:
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
        "step_s": C.median([c["step_s"] for c in ok]),
        "all_restored_newest": all(c["restored_ok"] for c in ok),
        "torn_seen": sum(len(c["torn"]) for c in ok),
        "restore_rss_ratio": C.median([c.get("restore_rss_ratio") for c in ok]),
        "restore_rss_added": C.median([c.get("restore_rss_added") for c in ok]),
        "fingerprint_s": C.median([c.get("fingerprint_s") for c in ok]),
        "cold_read_bytes": C.median([c.get("cold_read_bytes") for c in ok]),
        "cold_read_s": C.median([c.get("cold_read_s") for c in ok]),
        "load_vs_read": C.median([c.get("load_vs_read") for c in ok]),
        "verify_vs_load": C.median([c.get("verify_vs_load") for c in ok]),
    }


def print_summary(s: dict, args: argparse.Namespace, ranks: int) -> None:
    print(f"\n-- recovery, {ranks} rank(s), state {args.size_bytes / C.GiB:.3g} GiB, save every {args.every} steps "
          f"(~{args.every * (s['step_s'] or 0):.1f}s), {s['n']} cycles, page cache {'warm' if args.warm else 'evicted'} --")
    print(f"time from launch to the first resumed step: {C.fmt(s['time_to_first_step_s'], '.2f')}s "
          f"(restore {C.fmt(s['restore_s'], '.2f')}s = {C.fmt(C.ratio(args.size_bytes / 1e9, s['restore_s']), '.2f')} GB/s)")
    total = s["time_to_first_step_s"] or 0
    for p in PHASES:
        v = s["phases"][p]
        print(f"  {p:<14}{C.fmt(v, '.3f'):>8}s {C.fmt(None if not total or v is None else 100 * v / total, '.0f'):>4}%")
    print_limits(s)
    print(f"work lost per failure: median {C.fmt(s['lost_steps_median'], '.0f')} steps "
          f"({C.fmt(s['lost_s_median'], '.1f')}s), mean {C.fmt(s['lost_steps_mean'], '.1f')}, max {s['lost_steps_max']} "
          f"(save every {args.every}: a kill at a uniformly random step loses ~{args.every / 2:.0f} + the commit lag)")
    print(f"restore memory: building the state and restoring it added {C.fmt(C.ratio(s['restore_rss_added'], C.MiB), '.0f')} MiB "
          f"of RSS per rank = {C.fmt(s['restore_rss_ratio'], '.2f')}x the rank's state (median; floor 2.0 = live state "
          f"+ fresh load buffers; target <= 2.1)")
    print(f"restored the newest committed checkpoint every time: {s['all_restored_newest']}; "
          f"torn (uncommitted) step directories seen and skipped: {s['torn_seen']}")


def print_limits(s: dict) -> None:
    """The load against a cold sequential read of the same bytes, and the verify against the load (medians)."""
    load, verify, read_s = s["phases"]["load"], s["phases"]["verify"], s["cold_read_s"]
    print(f"load {C.fmt(load, '.3f')}s against a cold sequential read of the same "
          f"{C.fmt(C.ratio(s['cold_read_bytes'], 1e6), '.0f')} MB in {C.fmt(read_s, '.3f')}s "
          f"({C.fmt(C.ratio(C.ratio(s['cold_read_bytes'], 1e9), read_s), '.2f')} GB/s): the load runs at "
          f"{C.fmt(s['load_vs_read'], '.2f')}x the read (goal >= 0.80x)")
    print(f"verify {C.fmt(verify, '.3f')}s = {C.fmt(None if s['verify_vs_load'] is None else 100 * s['verify_vs_load'], '.0f')}% "
          f"of the load (goal <= 15%); fingerprints {C.fmt(s['fingerprint_s'], '.3f')}s of it")


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--size-gib", type=float, default=None, help="state size in GiB (default 1; --quick: 1/16)")
    p.add_argument("--tensor-mib", type=float, default=None, help="size of one tensor in MiB (default 64; --quick: 8)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=None, help="kill/resume cycles (default 5; --quick: 2)")
    p.add_argument("--every", type=int, default=None, help="save every N steps (default 20; --quick: 10)")
    p.add_argument("--step-s", type=float, default=None, help="toy training step in seconds (default 0.5; --quick: 0.05)")
    p.add_argument("--async-mode", default="process", choices=("process", "thread", "off"))
    p.add_argument("--writer-threads", type=int, default=1)
    p.add_argument("--matmul-n", type=int, default=512)
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
    a.step_s = a.step_s if a.step_s is not None else (0.05 if q else 0.5)
    return a


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    C.exit_on_sigterm()
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-recovery-")
    stamp = C.timestamp()
    log_path = C.RESULTS_DIR / f"recovery_{stamp}.log"
    C.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t0 = time.time()
    print(f"checkpoints under {args.dir}; worker logs in {log_path}", flush=True)
    suites = []
    failures = 0
    try:
        for ranks in args.ranks:
            threads = max(1, (os.cpu_count() or 1) // ranks)
            cal = calibrate(threads, args.matmul_n, args.step_s)
            base = {"ranks": ranks, "threads": threads, "size_bytes": args.size_bytes,
                    "tensor_bytes": args.tensor_bytes, "every": args.every, "async_mode": args.async_mode,
                    "writer_threads": args.writer_threads, **cal}
            cycles = []
            for i in range(args.repeats):
                try:
                    c = run_cycle(args, base, i, log_path, rng)
                    print(f"  cycle {i + 1}/{args.repeats}: killed after step {c['last_step']}, newest committed "
                          f"{max(c['committed']) if c['committed'] else None} (lost {c['lost_steps']} steps), "
                          f"resumed from {c['restored_step']} in {c['time_to_first_step_s']:.2f}s, "
                          f"restore RSS {c['restore_rss_ratio']:.2f}x the state; load {c['phases']['load']:.3f}s, "
                          f"cold read {C.fmt(c['cold_read_s'], '.3f')}s ({C.fmt(c['load_vs_read'], '.2f')}x), "
                          f"verify {c['phases']['verify']:.3f}s", flush=True)
                except Exception as e:  # noqa: BLE001
                    failures += 1
                    c = {"cycle": i, "error": str(e)}
                    print(f"  cycle {i + 1}/{args.repeats} failed: {str(e).splitlines()[0]}", flush=True)
                cycles.append(c)
            suites.append({"ranks": ranks, "calibration": cal, "cycles": cycles, "summary": summarize(cycles, args)})
    finally:
        if own_dir:
            C.rmtree(args.dir)
    for s in suites:
        print_summary(s["summary"], args, s["ranks"])
    payload = {"benchmark": "recovery", "timestamp": stamp, "wall_s": time.time() - t0, "machine": C.machine_info(),
               "config": {k: v for k, v in vars(args).items() if k != "worker"}, "phases": PHASES, "suites": suites}
    paths = C.save_json(f"recovery_{stamp}.json", payload, args.out)
    print(f"\nwrote {', '.join(map(str, paths))} in {time.time() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
