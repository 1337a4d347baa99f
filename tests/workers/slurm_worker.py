"""Worker: one SLURM task of a 2-task DDP job (the environment says so), with SLURM auto-requeue.

Rank ``--signal-rank`` sends itself SIGUSR1 (the requeue signal) after step ``--signal-at``. Writes
``<out>.rank<R>.json`` with what it saw: the step it resumed from and the last step it trained.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import lightning.pytorch as L
from lightning.pytorch.plugins.environments import SLURMEnvironment

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import lightning_train  # noqa: E402

from lightning_ckpt import DistributedCheckpoint  # noqa: E402


class Signal(L.Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal-rank", type=int, default=1)
    args = p.parse_args()
    cb = DistributedCheckpoint(args.root, every_n_train_steps=100, async_mode="thread")
    callbacks = [cb] + ([Signal(args.signal_rank, args.signal_at)] if args.signal_at else [])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=os.path.dirname(args.out), callbacks=callbacks,
                        plugins=[SLURMEnvironment(requeue_signal=signal.SIGUSR1)])
    facts = {"resumed_from": None, "step": None}
    try:
        trainer.fit(lightning_train.Regressor())
    finally:
        facts.update(resumed_from=cb.resumed_from, step=trainer.global_step)
        with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(facts, f)


if __name__ == "__main__":
    main()
