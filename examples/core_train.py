"""A small training run on the core API: dropout, AdamW, a LR scheduler, shuffled data, checkpoints.

Runs as one process (``python examples/core_train.py``) or many
(``torchrun --nproc-per-node 2 examples/core_train.py``, DDP over gloo).
``--kill-at-step N`` SIGKILLs every rank (or only ``--kill-rank R``) right
after step N (a crash), only in the first attempt of an elastic job; running
again with the same ``--root`` resumes by itself. SIGTERM/SIGUSR1 to any rank
saves at the next step boundary on every rank and exits with code 143.
``--out`` writes the per-step losses, the samples seen and the final state;
``--trace DIR`` appends one JSON line per step and rank (to audit elastic runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ckpt_core import CheckpointManager, ResumableDistributedSampler, ResumableLoader, TrainState
from ckpt_core.elastic import init_process_group


class IndexedData(Dataset):
    """Synthetic regression data that also returns each sample's index (to audit the order)."""

    def __init__(self, n: int = 96, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def build(args: argparse.Namespace):
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(8, args.width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(args.width, 1))
    if dist.is_initialized() and args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    data = IndexedData(args.samples)
    loader = ResumableLoader(
        DataLoader(data, batch_size=args.batch_size, sampler=ResumableDistributedSampler(data, seed=7))
    )
    return model, opt, sched, loader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=32, help="hidden units of the model")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--async-mode", default="thread", choices=["process", "bytes", "thread", "off"])
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=None, help="only this rank dies (default: all)")
    p.add_argument("--commit-before-kill", action="store_true",
                   help="wait until the saves and local snapshots in flight are committed, then die")
    p.add_argument("--local-every", type=int, default=None,
                   help="local tier: snapshot into node memory every N steps (local_every_n_steps)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--trace", default=None, help="directory for per-step JSON lines")
    p.add_argument("--storage-options", default=None, help="JSON fsspec options for --root")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    if "RANK" in os.environ:
        init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    model, opt, sched, loader = build(args)
    state = TrainState(model=model, optimizers=opt, schedulers=sched, dataloader=loader)
    manager = CheckpointManager(args.root, every_n_steps=args.every, async_mode=args.async_mode,
                                keep_last=args.keep_last, local_every_n_steps=args.local_every,
                                storage_options=json.loads(args.storage_options or "{}"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = dist.get_world_size() if dist.is_initialized() else 1
    trace = None
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        trace = open(os.path.join(args.trace, f"trace.attempt{attempt}.rank{rank}.world{world}.jsonl"), "a")
    info = manager.resume(state)
    resumed_from = info.step if info else None
    step = state.step
    losses, seen = {}, []
    while step < args.steps:
        state.epoch = loader.epoch
        for x, y, idx in loader:
            step += 1
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses[step] = loss.item()
            seen.append([loader.epoch, *idx.tolist()])
            manager.record_loss(step, loss.item())
            if trace is not None:
                trace.write(json.dumps({"step": step, "epoch": loader.epoch, "idx": idx.tolist(),
                                        "loss": loss.item(), "resumed_from": resumed_from,
                                        "pid": os.getpid()}) + "\n")
                trace.flush()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            state.epoch = loader.epoch
            manager.maybe_save(step, state)
            if step == args.kill_at_step and attempt == 0 and args.kill_rank in (None, rank):
                if args.commit_before_kill:
                    manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.steps:
                break
    manager.close(completed=True)  # a clean end: the local tier's snapshots of this job are removed
    if args.out:
        out = f"{args.out}.rank{rank}"
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))  # on every rank
        torch.save({"model": msd, "optim": osd}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump({"resumed_from": resumed_from, "losses": losses, "seen": seen,
                       "resume_check_failures": manager.resume_check_failures}, f)
    if rank == 0:
        print(f"finished step {step}" + (f" (resumed from step {resumed_from})" if resumed_from else ""))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
