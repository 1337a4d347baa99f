"""A small Accelerate training run with fault-tolerant checkpoints (``accelerate_ckpt``).

A model with dropout, AdamW, a LR scheduler and a shuffled ``DataLoader`` of
synthetic tensors, prepared by ``Accelerator(cpu=True)``. Runs as one process
or many, unchanged::

    python examples/accelerate_train.py --dirpath ckpts --steps 40
    torchrun --nproc-per-node 2 examples/accelerate_train.py --dirpath ckpts --steps 40
    accelerate launch --cpu examples/accelerate_train.py --dirpath ckpts

Running it again with the same ``--dirpath`` resumes from the newest valid
checkpoint, mid-epoch, at any process count. Checkpoint settings also come
from ``CKPT_<NAME>`` environment variables and ``--ckpt.<name>`` flags
(``--ckpt.every_n_steps 10``, ``CKPT_KEEP_LAST=2``).

Test hooks: ``--kill-at-step N`` SIGKILLs every process right after step N
(a crash, no cleanup); ``--out DIR`` writes, per rank, one JSON line per step
(loss as an exact float, the dataset indices of the batch) to
``DIR/rank<R>.jsonl``, the final weights to ``DIR/final_rank<R>.pt`` and the
optimizer and scheduler state to ``DIR/final_optim_rank<R>.pt``.
``--commit-before-kill`` waits, before that SIGKILL, until the checkpoint and
the local snapshot in flight are committed (``plugin.wait()``).

Local tier: ``--local-every N`` also snapshots every process's state into
node memory every N steps (``CheckpointPlugin(local_every_n_steps=N)``), under
``--local-dir DIR`` (default ``/dev/shm/ckpt-<uid>``). A relaunch finds the
snapshots only with the same job id (``CKPT_RUN_ID``, or torchrun's
``--rdzv-id``) and resumes from the newest one when it is newer than the
newest checkpoint under ``--dirpath``; ``--log-level INFO`` shows the core's
line saying so (``logging.basicConfig``)::

    export CKPT_RUN_ID=job1
    torchrun --nproc-per-node 2 examples/accelerate_train.py --dirpath ckpts --every-n-steps 10 \\
        --local-every 2 --kill-at-step 17 --commit-before-kill    # crash, step 16's snapshot committed
    torchrun --nproc-per-node 2 examples/accelerate_train.py --dirpath ckpts --every-n-steps 10 \\
        --local-every 2 --log-level INFO                          # resumes at 16 (durable tier's: 10)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class IndexedData(Dataset):
    """Synthetic regression data; each sample also returns its index, to audit the order."""

    def __init__(self, n: int = 96, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirpath", default="checkpoints", help="checkpoint root (path or fsspec URL)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps to train in total")
    p.add_argument("--every-n-steps", type=int, default=5, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--samples", type=int, default=96, help="dataset size")
    p.add_argument("--batch-size", type=int, default=4, help="per-process batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=32, help="hidden units of the model")
    p.add_argument("--stateful-dataloader", action="store_true",
                   help="DataLoaderConfiguration(use_stateful_dataloader=True): torchdata StatefulDataLoader")
    p.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL every process right after step N")
    p.add_argument("--commit-before-kill", action="store_true",
                   help="before the --kill-at-step SIGKILL, wait until the checkpoint and the local snapshot in "
                        "flight are committed")
    p.add_argument("--local-every", type=int, default=None,
                   help="local tier: snapshot into node memory every N steps (local_every_n_steps)")
    p.add_argument("--local-dir", default=None, help="local tier: the node-local directory of snapshots")
    p.add_argument("--log-level", default=None, help="configure logging at this level (INFO shows the core's lines)")
    p.add_argument("--out", default=None, help="directory for per-step records and final weights (tests)")
    args, unknown = p.parse_known_args(argv)
    from ckpt_core.config import pop_ckpt_flags

    _, rest = pop_ckpt_flags(unknown)  # --ckpt.<name> flags are read by the plugin
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.log_level:
        logging.basicConfig(level=args.log_level.upper())
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from accelerate_ckpt import Accelerator, CheckpointPlugin

    local = {k: v for k, v in (("local_every_n_steps", args.local_every), ("local_dir", args.local_dir)) if v}
    plugin = CheckpointPlugin(dirpath=args.dirpath, every_n_steps=args.every_n_steps, keep_last=args.keep_last,
                              **local)
    accelerator = Accelerator(
        cpu=True,
        checkpoint_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.stateful_dataloader),
    )
    set_seed(args.seed)
    model = nn.Sequential(nn.Linear(8, args.width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)
    if args.stateful_dataloader:
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        Loader = DataLoader
    dataloader = Loader(IndexedData(args.samples), batch_size=args.batch_size, shuffle=True)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)

    info = plugin.resume()  # the newest valid checkpoint (None on a fresh start): restores everything
    rank = accelerator.process_index
    out = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = open(os.path.join(args.out, f"rank{rank}.jsonl"), "a")
        out.write(json.dumps({"event": "start", "resumed_from": None if info is None else info.step,
                              "world_size": accelerator.num_processes, "rank": rank,
                              "epoch": plugin.epoch}) + "\n")
        out.flush()
    accelerator.print(f"start at step {plugin.global_step} (epoch {plugin.epoch}) on "
                      f"{accelerator.num_processes} process(es)")

    loss_fn = nn.MSELoss()
    model.train()
    while plugin.global_step < args.steps:
        for x, y, idx in plugin.dataloader(dataloader):  # continues mid-epoch after a resume
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            epoch = plugin.epoch
            plugin.step(loss=loss)  # counts the step, saves when due (async, sharded)
            mean_loss = accelerator.reduce(loss.detach(), reduction="mean")  # across processes
            if out is not None:
                out.write(json.dumps({"event": "step", "step": plugin.global_step, "epoch": epoch,
                                      "loss": loss.item(), "mean_loss": mean_loss.item(),
                                      "indices": idx.tolist()}) + "\n")
                out.flush()
            if args.kill_at_step is not None and plugin.global_step == args.kill_at_step:
                if args.commit_before_kill:
                    plugin.wait()  # the save and the local snapshot in flight are committed, on every process
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing is flushed or closed
            if plugin.global_step >= args.steps:
                break

    plugin.close()  # waits for the last save to be committed (end_training() then removes the local snapshots)
    accelerator.wait_for_everyone()
    if out is not None:
        weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(weights, os.path.join(args.out, f"final_rank{rank}.pt"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(args.out, f"final_optim_rank{rank}.pt"))
        out.write(json.dumps({"event": "end", "step": plugin.global_step,
                              "distributed_type": accelerator.distributed_type.value,
                              "process_group": torch.distributed.is_initialized()}) + "\n")
        out.close()
    accelerator.print(f"done at step {plugin.global_step}")
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
