"""Worker: frequent async saves while retention deletes concurrently (2 ranks under torchrun).

Between steps rank 0 samples the directory and checks that the newest committed
checkpoint is complete (every manifest file present with its size). At the end
it restores the newest one and writes what it saw to --out.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.discovery import list_records, read_manifest, validate
from ckpt_core.storage import get_fs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = TrainState(model=model, optimizers=opt)
    groups = len(dist.distributed_c10d._world.pg_map)  # the default group (DDP's)
    m = CheckpointManager(args.root, every_n_steps=2, keep_last=2, keep_every_n_steps=10, async_mode="process")
    fs = get_fs(args.root)[0]
    samples, problems = 0, []
    for step in range(1, args.steps + 1):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        m.maybe_save(step, state)
        if rank == 0:
            committed = [r for r in list_records(args.root) if r.committed]
            if committed:
                newest = committed[-1]
                samples += 1
                try:
                    problem = validate(newest.path, read_manifest(fs, newest.path), "size")
                except FileNotFoundError as e:  # deleted between listing and reading
                    problem = f"vanished: {e}"
                if problem:
                    problems.append(f"step {step}: newest committed {newest.step}: {problem}")
    m.close()
    groups_left = [len(dist.distributed_c10d._world.pg_map) - groups]  # close() destroyed the manager's groups
    fresh = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
    with CheckpointManager(args.root, async_mode="off", handle_preemption=False) as m2:
        info = m2.restore(TrainState(model=fresh, optimizers=torch.optim.SGD(fresh.parameters(), lr=0.01)))
    groups_left.append(len(dist.distributed_c10d._world.pg_map) - groups)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    if rank == 0:
        final = {r.step: r.committed for r in list_records(args.root)}
        json.dump({"samples": samples, "problems": problems, "final": final, "restored": info.step,
                   "same_params": same, "groups_left": groups_left}, open(args.out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
