"""Page-cache benchmark: what the kernel's copy of a write into the page cache costs, against a direct write.

    python -m benchmarks.pagecache                      # 0.5 GiB, idle gaps 0, 1 and 5 s, 5 rounds
    python -m benchmarks.pagecache --size-gib 1 --gaps 0 5 --rounds 8
    python -m benchmarks.pagecache --saves              # also synchronous saves, direct_io on and off

Each round writes the same warm buffer (``--size-gib`` of random bytes) to a
new file on ``--dir`` and fsyncs it, in three ways: buffered after an idle gap
of each ``--gaps`` second(s), and with ``O_DIRECT`` through the library's
``direct_io.DirectFile`` (page-aligned 8 MiB chunks) after the longest gap.
It reports, per way, the medians (and every round) of the writing thread's
system and user CPU per GiB and of the wall time per GiB. On machines that
hand freed memory back to a hypervisor (virtio-balloon free page reporting),
page-cache pages taken after an idle gap are first touches and cost several
times more CPU than those taken right after another write: the save
benchmark's ``write`` component (a write right after another) then
understates what a background save pays. ``--saves`` adds, after the same
gaps, a synchronous ``CheckpointManager.save`` (``async_mode="off"``) of the
same bytes as 4 fp32 tensors with ``direct_io`` on and off: the save call's
wall time and the process's CPU per GiB. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # allow ``python benchmarks/pagecache.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _common as C  # noqa: E402


def _thread_cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_stime, r.ru_utime


def write_buffered(path: str, data: memoryview) -> None:
    with open(path, "wb") as f:
        for off in range(0, len(data), 64 * C.MiB):
            f.write(data[off:off + 64 * C.MiB])
        f.flush()
        os.fsync(f.fileno())


def write_direct(path: str, data: memoryview) -> None:
    from ckpt_core.direct_io import open_direct

    f = open_direct(path, sync=True)
    if f is None:
        raise SystemExit(f"{os.path.dirname(path)}: this file system refuses O_DIRECT; pick --dir elsewhere")
    f.write(data)
    f.close()


def _cpu(tree: bool) -> tuple[float, float]:
    """System and user CPU seconds of this thread, or (``tree``) of the whole process and its children."""
    if not tree:
        return _thread_cpu()
    r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_stime + c.ru_stime, r.ru_utime + c.ru_utime


def measure(write, path: str, data: memoryview, tree: bool = False) -> dict:
    """One write: system and user CPU (this thread, or the process for a save) and wall time, per GiB."""
    gib = len(data) / C.GiB
    (s0, u0), t0 = _cpu(tree), time.perf_counter()
    write(path, data)
    (s1, u1), t1 = _cpu(tree), time.perf_counter()
    if os.path.exists(path):
        os.unlink(path)
    return {"sys": (s1 - s0) / gib, "user": (u1 - u0) / gib, "wall": (t1 - t0) / gib}


def save_ways(gaps: list, tmp: str, size: int) -> list:
    """(name, gap, write) for synchronous saves of ``size`` bytes, direct and buffered, after each gap."""
    import torch

    from ckpt_core import CheckpointManager, TrainState

    model = torch.nn.Module()
    for i in range(4):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.rand(size // 16)))
    state = TrainState(model=model)
    ways = []
    for direct in (True, False):
        mgr = CheckpointManager(os.path.join(tmp, f"direct_{direct}"), async_mode="off", keep_last=1, resume=False,
                                direct_io=direct, lease=False, handle_preemption=False)
        steps = iter(range(1, 1 << 30))
        mgr.save(next(steps), state)  # warm-up
        for g in gaps:
            ways.append((f"save, {'direct' if direct else 'buffered'}, {g:g} s idle", g,
                         lambda _p, _d, m=mgr, it=steps: m.save(next(it), state)))
    return ways


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--gaps", type=float, nargs="+", default=[0, 1, 5], help="idle seconds before a buffered write")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--saves", action="store_true", help="also synchronous saves, direct_io on and off")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    data = memoryview(torch.randint(0, 256, (int(args.size_gib * C.GiB),), dtype=torch.uint8).numpy()).cast("B")
    ways = [(f"buffered, {g:g} s idle", g, write_buffered) for g in args.gaps]
    ways.append((f"direct, {max(args.gaps):g} s idle", max(args.gaps), write_direct))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if args.saves:
            ways += save_ways(args.gaps, tmp, len(data))
        samples: dict[str, list] = {name: [] for name, _, _ in ways}
        path = os.path.join(tmp, "w.bin")
        write_buffered(path, data)  # warm-up
        os.unlink(path)
        for r in range(args.rounds):
            for name, gap, write in (ways if r % 2 == 0 else ways[::-1]):
                time.sleep(gap)
                samples[name].append(measure(write, path, data, tree=name.startswith("save")))
    print(f"{args.size_gib:g} GiB per write, {args.rounds} rounds, s/GiB (median; every round):")
    for name, rows in samples.items():
        cols = {k: [row[k] for row in rows] for k in ("sys", "user", "wall")}
        print(f"  {name:26s}" + "  ".join(f"{k} {C.median(v):.3f} [{' '.join(f'{x:.2f}' for x in v)}]"
                                             for k, v in cols.items()))
    paths = C.save_json(f"pagecache_{C.timestamp()}.json",
                        {"machine": C.machine_info(), "args": vars(args), "samples": samples}, args.out)
    print("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
