"""``maybe_save`` on a step where nothing is due, at 2 ranks: what the training loop pays per step.

Reports, interleaved in one run (medians over rounds after a warm-up), the time spent inside one
``maybe_save`` call with preemption handling on (the flags exchanged without a wait, read at the next step)
next to the blocking all-reduce of the same flags that such a step used to cost; each step first sleeps
``--step-ms`` (the step's own work).

    python -m benchmarks.maybe_save [--steps 2000] [--rounds 7] [--ranks 2] [--step-ms 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, steps: int, rounds: int, step_s: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckpt_core import CheckpointManager, TrainState

    state = TrainState(model=torch.nn.Linear(4, 4), rng=False)
    m = CheckpointManager(f"/tmp/ckpt-bench-maybe-save-{port}", every_n_steps=10**9, async_mode="thread",
                          lease=False, env={}, argv=[])
    group = m._ctl.group
    results: dict[str, list[float]] = {"maybe_save": [], "blocking all_reduce": []}
    step = 0
    for r in range(rounds + 1):
        for name in results:
            dist.barrier(group=group)
            inside = 0.0
            for _ in range(steps):
                step += 1
                time.sleep(step_s)  # the step's own work, during which the exchange can complete
                t0 = time.perf_counter()
                if name == "maybe_save":
                    m.maybe_save(step, state)
                else:
                    dist.all_reduce(torch.tensor([0, 0], dtype=torch.int64), op=dist.ReduceOp.MAX, group=group)
                inside += time.perf_counter() - t0
            per_call = inside / steps * 1e6
            if r > 0:  # round 0 warms up
                results[name].append(per_call)
    m.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=2.0, help="simulated work of one training step")
    args = p.parse_args()
    from torch.distributed.elastic.utils.distributed import get_free_port

    out = f"/tmp/ckpt-bench-maybe-save-{os.getpid()}.json"
    mp.spawn(_worker, args=(args.ranks, get_free_port(), args.steps, args.rounds, args.step_ms / 1e3, out), nprocs=args.ranks)
    res = json.load(open(out))
    print(f"{args.ranks} ranks, {args.steps} steps of {args.step_ms:g} ms x {args.rounds} rounds, rank 0, "
          "microseconds inside the call per step (median):")
    for name, xs in res.items():
        print(f"  {name:22s} {statistics.median(xs):8.1f}   (min {min(xs):.1f}, max {max(xs):.1f})")
    ratio = statistics.median(res["maybe_save"]) / statistics.median(res["blocking all_reduce"])
    print(f"  maybe_save / blocking all_reduce = {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
