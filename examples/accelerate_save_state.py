"""A training script in the style of Accelerate's ``examples/by_feature/checkpointing.py``, plus one line.

The script saves with ``accelerator.save_state(<output_dir>/step_<N>)`` (or
``epoch_<E>``) and resumes with ``--resume_from_checkpoint <dir>``, working out
the epoch and the batches to skip from the directory's name, as Accelerate's
example does. The only line added for fault tolerance is
``CheckpointPlugin().attach(accelerator)``; with it the resumed run is the
uninterrupted run, bit for bit, also across the next epoch boundary.

    python examples/accelerate_save_state.py --output_dir out --checkpointing_steps 6
    python examples/accelerate_save_state.py --output_dir out --resume_from_checkpoint out/step_12
    torchrun --nproc-per-node 2 examples/accelerate_save_state.py --output_dir out --checkpointing_steps 3

``--skip first_batches`` skips with ``accelerator.skip_first_batches`` instead
of the example's ``continue``; ``--record PREFIX`` writes ``PREFIX.losses``
(``step loss`` with the loss as a float hex string), ``PREFIX.pt`` (model,
optimizer and scheduler state at the end); ``--kill-at-step N`` SIGKILLs the
process after step N.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_ckpt import CheckpointPlugin


def get_dataloader(n: int = 64, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default=".")
    p.add_argument("--checkpointing_steps", default=None, help="save every N steps, or 'epoch'")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--num_epochs", type=int, default=4)
    p.add_argument("--skip", choices=["loop", "first_batches"], default="loop")
    p.add_argument("--record", default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    return p.parse_args(argv)


def resume_point(accelerator: Accelerator, path: str, batches_per_epoch: int) -> tuple[int, Optional[int]]:
    """``(starting_epoch, batches to skip in it)`` from an ``epoch_<E>``/``step_<N>`` directory name."""
    accelerator.print(f"Resumed from checkpoint: {path}")
    accelerator.load_state(path)
    name = os.path.basename(path.rstrip("/"))
    if name.startswith("epoch_"):
        return int(name[len("epoch_"):]) + 1, None
    done = int(name[len("step_"):])
    return done // batches_per_epoch, done % batches_per_epoch


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    CheckpointPlugin().attach(accelerator)  # the one line added
    set_seed(42)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_dataloader = get_dataloader()
    total = len(train_dataloader) * args.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5) * (1 - s / total))
    model, optimizer, train_dataloader, scheduler = accelerator.prepare(model, optimizer, train_dataloader, scheduler)
    every = args.checkpointing_steps
    every = int(every) if every is not None and every.isdigit() else every

    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint:
        starting_epoch, resume_step = resume_point(accelerator, args.resume_from_checkpoint, len(train_dataloader))
    overall_step = starting_epoch * len(train_dataloader)
    losses = open(f"{args.record}.losses", "a") if args.record and accelerator.is_main_process else None
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        batches = train_dataloader
        if resume_step and epoch == starting_epoch and args.skip == "first_batches":
            batches = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        for step, (x, y) in enumerate(batches):
            if resume_step and epoch == starting_epoch and args.skip == "loop" and step < resume_step:
                overall_step += 1
                continue
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            if losses is not None:
                losses.write(f"{overall_step} {loss.item().hex()}\n")
                losses.flush()
            if isinstance(every, int) and overall_step % every == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
            if overall_step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        if every == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    accelerator.end_training()
    if args.record and accelerator.is_main_process:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, f"{args.record}.pt")


if __name__ == "__main__":
    main()
