"""Worker: FSDP2 (fully_shard) training that saves at one world size and resumes at another.

phase=save: train ``--save-step`` steps, save, dump the full state and the samples seen.
phase=resume: restore (resharding), dump the full restored state, then finish the
epoch and dump the samples seen after the resume; ``--also ROOT OUT`` (repeatable)
does the same again in the same processes from another root, with a fresh model,
optimizer, loader and manager (one launch for several resumes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from ckpt_core import CheckpointManager, ResumableDistributedSampler, ResumableLoader, TrainState


class Indexed(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(6, generator=g), i


def full_copy(model: nn.Module, opt: torch.optim.Optimizer):
    """Full (unsharded) model and optimizer state, cloned so later training cannot alias it."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return {k: clone(v) for k, v in msd.items()}, {
        "state": {k: {n: clone(t) for n, t in v.items()} for k, v in osd.get("state", {}).items()},
    }


def threads() -> int:
    """This process's threads, Python's and C++'s (a live gloo process group holds a few)."""
    return len(os.listdir("/proc/self/task"))


def run(root: str, phase: str, save_step: int, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = Indexed()
    loader = ResumableLoader(DataLoader(data, batch_size=2, sampler=ResumableDistributedSampler(data, seed=3)))
    state = TrainState(model=model, optimizers=opt, dataloader=loader)
    threads_before = threads()
    manager = CheckpointManager(root, async_mode="off")
    seen: list[int] = []
    if phase == "resume":
        info = manager.resume(state)
        assert info is not None
    step = state.step
    full_at_restore = None
    if phase == "resume":
        full_at_restore = full_copy(model, opt)
    for x, idx in loader:
        step += 1
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        seen.extend(idx.tolist())
        if phase == "save" and step == save_step:
            full = full_copy(model, opt)
            manager.save(step, state)
            manager.wait()
            break
    manager.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (seen, threads_before, threads()))
    if rank == 0:
        if phase == "save":
            torch.save({"model": full[0], "optim": full[1]}, out + ".pt")
        else:
            torch.save({"model": full_at_restore[0], "optim": full_at_restore[1]}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump({"seen": sorted(i for r, _, _ in gathered for i in r), "world": world, "step": step,
                       "threads": [[b, a] for _, b, a in gathered]}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--phase", choices=["save", "resume"], required=True)
    p.add_argument("--save-step", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("ROOT", "OUT"),
                   help="phase=resume: then resume again from ROOT, writing OUT")
    args = p.parse_args()
    dist.init_process_group("gloo")
    gc.disable()  # what the manager leaves behind must be freed by reference counting and close() alone
    run(args.root, args.phase, args.save_step, args.out)
    for root, out in args.also:
        run(root, "resume", args.save_step, out)
    # fully_shard's modules hold the default group in reference cycles: free them while the interpreter is
    # alive, so that destroying the group joins its gloo threads now rather than during interpreter exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
