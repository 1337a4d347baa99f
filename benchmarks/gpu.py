"""GPU save benchmark: the stall against a pinned device-to-host copy, persist against the disk, RNG exactness.

One process, the state on the device (fp32 tensors of ``--tensor-mib``) as
the parameters of a plain module, saved by ``CheckpointManager`` with its
defaults (``async_mode="process"``; on a CUDA host the staging copy is
pinned). For each size of ``--sizes-gib``, interleaved over ``--repeats``
rounds after one warm-up save:

* *copy*: a warm device-to-host copy of the same bytes into preallocated
  pinned buffers (``copy_`` and a device synchronize): the least a
  consistent asynchronous save can block training;
* *stall*: the time ``save()`` blocks the caller; goal: stall ÷ copy ≤ 1.2;
* *write*: an fsync'd sequential write of the same bytes from those pinned
  buffers to the checkpoint directory's file system;
* *persist*: ``save()`` until ``wait()`` returns (the checkpoint committed);
  reported as write ÷ persist (1.0 = as fast as the disk).

Then one resume check: a model and its RNG states (CPU and every CUDA
device) saved, a sequence drawn after the save, the state restored into a
fresh manager, the same sequence drawn again: it must be equal bit for bit.

``python -m benchmarks.gpu --sizes-gib 4 8`` (about 5 minutes on an H100
host at 8 GiB); ``--device cpu --sizes-gib 0.0625`` checks that the script
runs on a machine without a GPU (the figures then mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks import _common as C


def _device_sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _state(size_bytes: int, tensor_bytes: int, device: str) -> Any:
    model, _, _ = C.build_model(size_bytes, tensor_bytes, rank=0, world=1)
    return model.to(device)


def _host_buffers(model: Any, device: str) -> list:
    import torch

    pin = device.startswith("cuda")
    return [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in model.parameters()]


def _copy_s(model: Any, bufs: list, device: str) -> float:
    """A warm device-to-host copy of every parameter into ``bufs``."""
    _device_sync(device)
    t0 = time.perf_counter()
    for b, p in zip(bufs, model.parameters()):
        b.copy_(p.detach())
    _device_sync(device)
    return time.perf_counter() - t0


def _round(mgr: Any, state: Any, model: Any, bufs: list, root: str, step: int, device: str) -> dict:
    """One round: the copy reference, one save (stall, persist), the fsync'd write reference."""
    copy_s = _copy_s(model, bufs, device)
    _device_sync(device)
    t0 = time.perf_counter()
    mgr.save(step, state)
    stall = time.perf_counter() - t0
    mgr.wait()
    persist = time.perf_counter() - t0
    path = os.path.join(root, "reference.bin")
    write_s = C.timed_write(path, bufs)["total_s"]
    os.remove(path)
    return {"copy_s": copy_s, "stall_s": stall, "persist_s": persist, "write_s": write_s}


def bench_size(size_gib: float, tensor_mib: float, repeats: int, device: str, root: str) -> dict:
    """``repeats`` rounds at one state size after a warm-up save; medians and ratios of totals."""
    from ckpt_core import CheckpointManager, TrainState

    size = int(size_gib * C.GiB)
    model = _state(size, int(tensor_mib * C.MiB), device)
    bufs = _host_buffers(model, device)
    state = TrainState(model=model)
    rounds = []
    with CheckpointManager(os.path.join(root, f"s{size_gib:g}"), keep_last=1, handle_preemption=False) as mgr:
        mgr.save(0, state)  # warm-up: the writer process, the staging buffers, the plan
        mgr.wait()
        for i in range(repeats):
            rounds.append(_round(mgr, state, model, bufs, root, i + 1, device))
    total = {k: sum(r[k] for r in rounds) for k in rounds[0]}
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {"size_gib": size_gib, "bytes": size, "rounds": rounds, "median": med,
            "stall_over_copy": total["stall_s"] / total["copy_s"],
            "write_over_persist": total["write_s"] / total["persist_s"],
            "persist_gb_s": size / med["persist_s"] / 1e9}


def rng_resume_exact(device: str, root: str) -> bool:
    """Whether draws after a restore repeat the draws after the save, on the CPU and ``device``."""
    import torch

    from ckpt_core import CheckpointManager, TrainState

    torch.manual_seed(1234)
    model = torch.nn.Linear(8, 8).to(device)
    torch.rand(3, device=device)  # move the generators off their seeded start
    path = os.path.join(root, "rng")
    with CheckpointManager(path, async_mode="off", handle_preemption=False) as mgr:
        mgr.save(1, TrainState(model=model))
    after_save = [torch.rand(16, device=device).cpu(), torch.rand(16).cpu()]
    torch.manual_seed(99)  # what a restarted job would have
    with CheckpointManager(path, async_mode="off", handle_preemption=False) as mgr:
        mgr.restore(TrainState(model=torch.nn.Linear(8, 8).to(device)))
    after_restore = [torch.rand(16, device=device).cpu(), torch.rand(16).cpu()]
    return all(torch.equal(a, b) for a, b in zip(after_save, after_restore))


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[4.0, 8.0])
    p.add_argument("--tensor-mib", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    import torch

    info = C.machine_info()
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-gpu-")
    results = [bench_size(s, args.tensor_mib, args.repeats, args.device, root) for s in args.sizes_gib]
    exact = rng_resume_exact(args.device, root)
    print(f"device {info.get('gpu', args.device)}; {info.get('cpu', '?')}; torch {info['torch']}")
    print("size GiB   copy s   stall s  stall/copy (goal <= 1.2)  write s  persist s  write/persist  GB/s")
    for r in results:
        m = r["median"]
        print(f"{r['size_gib']:8g} {m['copy_s']:8.3f} {m['stall_s']:9.3f} {r['stall_over_copy']:11.2f}"
              f"{'':15} {m['write_s']:8.3f} {m['persist_s']:10.3f} {r['write_over_persist']:14.2f}"
              f" {r['persist_gb_s']:5.2f}")
    print(f"RNG (CPU and {args.device}) after a restore equals after the save: {exact}")
    if args.dir is None:
        C.rmtree(root)
    payload = {"machine": info, "args": vars(args), "sizes": results, "rng_resume_exact": exact}
    for path in C.save_json(f"gpu_{C.timestamp()}.json", payload, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
