"""A small Lightning run with ``DistributedCheckpoint``: dropout, AdamW, a LR scheduler, shuffled data.

    python examples/lightning_train.py --dirpath /tmp/run1 --max-steps 24 --every-n-steps 4
    python examples/lightning_train.py --dirpath /tmp/run1 --max-steps 24 --kill-at-step 14   # crash
    python examples/lightning_train.py --dirpath /tmp/run1 --max-steps 24                     # resumes at 12
    python examples/lightning_train.py --dirpath /tmp/run2 --devices 2 --strategy ddp         # DDP (gloo)
    python examples/lightning_train.py --dirpath /tmp/run3 --devices 2 --strategy fsdp2       # FSDP2 (CPU)

``--kill-at-step N`` SIGKILLs every rank right after step N (after its
checkpoint, if one is due, was handed to the background writer);
``--sigterm-at-step N`` sends SIGTERM instead (a preemption: the next step is
saved and the run exits with code 143). ``--out PREFIX`` writes
``PREFIX.losses`` (``step loss`` per line, the loss as a float hex string, so
runs compare exactly), ``PREFIX.json`` (where the run resumed from, its last
step), ``PREFIX.weights.pt`` (the final parameters, gathered) and
``PREFIX.optim.pt`` (the final optimizer and scheduler states, DTensors
gathered).

Local tier: ``--local-every N`` also snapshots every rank's state into node
memory every N steps (``DistributedCheckpoint(local_every_n_train_steps=N)``),
under ``--local-dir DIR`` (default ``/dev/shm/ckpt-<uid>``); a relaunch finds
the snapshots only with the same job id (``CKPT_RUN_ID``)::

    export CKPT_RUN_ID=job1
    python examples/lightning_train.py --dirpath /tmp/run4 --every-n-steps 10 --local-every 2 \\
        --kill-at-step 17 --commit-before-kill        # crash, step 16's snapshot committed
    python examples/lightning_train.py --dirpath /tmp/run4 --every-n-steps 10 --local-every 2 \\
        --log-level INFO                              # resumes at 16 (durable tier's newest: 10)

``--commit-before-kill`` waits, before the ``--kill-at-step`` SIGKILL, until
the checkpoint and the local snapshot in flight are committed
(``callback.manager.wait()``). ``--log-level LEVEL`` configures Python's
logging (``logging.basicConfig``), which shows the core's INFO lines, such as
the one naming the tier a run resumed from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from typing import Any, Optional

import lightning.pytorch as L
import torch
from torch import nn
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_ckpt import DistributedCheckpoint


class Synthetic(Dataset):
    """Regression data; ``augment`` adds noise drawn from the global torch RNG as each sample is read."""

    def __init__(self, n: int, dim: int = 16, augment: bool = True, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.augment:
            x = x + 0.01 * torch.randn_like(x)
        return x, self.y[i]


class Stream(IterableDataset):
    """``Synthetic`` as a stream with no length: a seeded order per epoch, sharded by rank, resumable.

    Its own iterator, with ``state_dict``/``load_state_dict`` (epoch, position), which is how
    torchdata's ``StatefulDataLoader`` keeps the place of an ``IterableDataset``.
    """

    def __init__(self, n: int, seed: int = 7) -> None:
        self.data = Synthetic(n)
        self.seed = seed
        self.epoch, self.pos, self.done = 0, 0, False
        self.order: list[int] = []

    def _shard(self) -> None:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        perm = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.order = perm.tolist()[rank::world]

    def __iter__(self) -> "Stream":
        if self.done:
            self.epoch, self.pos, self.done = self.epoch + 1, 0, False
        self._shard()
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos >= len(self.order):
            self.done = True
            raise StopIteration
        self.pos += 1
        return self.data[self.order[self.pos - 1]]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos, self.done = int(state["epoch"]), int(state["pos"]), bool(state["done"])
        self._shard()


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers as full tensors (collective for FSDP2 DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in module.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def optimizer_states(trainer: L.Trainer) -> dict[str, Any]:
    """Every optimizer's and scheduler's ``state_dict``, with sharded (DTensor) state gathered (collective)."""
    from torch.distributed.tensor import DTensor

    def full(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: full(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(full(x) for x in v)
        return v.full_tensor() if isinstance(v, DTensor) else v

    return {"optimizers": [full(o.state_dict()) for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}


class Regressor(L.LightningModule):
    """An MLP with dropout; AdamW with a step LR schedule; shards itself with FSDP2 under ModelParallelStrategy."""

    def __init__(self, samples: int = 80, batch_size: int = 8, loader: str = "plain", lr: float = 1e-2,
                 num_workers: int = 0, val_batches: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Dropout(0.2), nn.Linear(32, 1))
        self.hooks: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        data = Synthetic(self.hparams.samples)
        kwargs = dict(batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers)
        if self.hparams.loader == "plain":
            return DataLoader(data, **kwargs)
        from torchdata.stateful_dataloader import StatefulDataLoader

        if self.hparams.loader == "stateful":
            return StatefulDataLoader(data, **kwargs)
        # "stream": an IterableDataset (no length: Lightning fetches a batch ahead), position kept by the loader
        return StatefulDataLoader(Stream(self.hparams.samples), batch_size=self.hparams.batch_size,
                                  num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> Any:
        return DataLoader(Synthetic(max(self.hparams.val_batches, 1) * 8, augment=False, seed=99), batch_size=8)

    # ---- instrumentation for the README and the tests
    def on_train_start(self) -> None:
        if self.hooks.get("weights_at_start"):
            self._dump(self.hooks["weights_at_start"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, h = self.trainer.global_step, self.hooks
        if h.get("losses") and self.trainer.is_global_zero:
            with open(h["losses"], "a") as f:
                f.write(f"{step} {float(outputs['loss']).hex()}\n")
        if h.get("weights_at_step") and step == h["weights_at_step"][0]:
            self._dump(h["weights_at_step"][1])
        if step == h.get("kill_at_step"):
            if h.get("commit_before_kill") is not None:
                h["commit_before_kill"].manager.wait()  # the save and the local snapshot in flight are committed
            os.kill(os.getpid(), signal.SIGKILL)
        if step == h.get("sigterm_at_step"):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self) -> None:
        if self.hooks.get("weights_at_end"):
            self._dump(self.hooks["weights_at_end"])
            optim = optimizer_states(self.trainer)
            if self.trainer.is_global_zero:
                torch.save(optim, self.hooks["weights_at_end"].replace(".weights.pt", ".optim.pt"))

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.trainer.global_step == self.hooks.get("sigterm_in_validation") and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def _dump(self, path: str) -> None:
        weights = full_weights(self)
        if self.trainer.is_global_zero:
            torch.save(weights, path)


class TwoOptimizers(Regressor):
    """Manual optimization: AdamW on the first layers, SGD with momentum on the last, each with its own schedule.

    Lightning counts an optimizer step of either optimizer, so ``global_step`` advances by 2 a batch.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        opts, scheds = self.optimizers(), self.lr_schedulers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt, sched in zip(opts, scheds):
            opt.step()
            sched.step()
        return loss

    def configure_optimizers(self) -> Any:
        head = list(self.net[-1].parameters())
        body = [p for p in self.net.parameters() if all(p is not h for h in head)]
        adam = torch.optim.AdamW(body, lr=self.hparams.lr)
        sgd = torch.optim.SGD(head, lr=self.hparams.lr, momentum=0.9)
        return [adam, sgd], [torch.optim.lr_scheduler.StepLR(adam, 5, 0.8),
                             torch.optim.lr_scheduler.CosineAnnealingLR(sgd, 40)]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirpath", required=True, help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--every-n-steps", type=int, default=4)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", choices=["auto", "ddp", "fsdp2"], default="auto")
    p.add_argument("--loader", choices=["plain", "stateful", "stream"], default="plain",
                   help="DataLoader(shuffle=True), StatefulDataLoader(shuffle=True), or a StatefulDataLoader "
                        "over an IterableDataset without length")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--samples", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-every", type=int, default=0, help="validate every N batches (0: no validation)")
    p.add_argument("--async-mode", choices=["bytes", "process", "thread", "off"], default=None)
    p.add_argument("--save-on-exception", action="store_true")
    p.add_argument("--ckpt-path", default=None, help="fit(ckpt_path=...): one of our checkpoint directories")
    p.add_argument("--csv-logs", default=None, help="log metrics (ckpt/* included) with a CSVLogger here")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local-every", type=int, default=None,
                   help="local tier: snapshot into node memory every N steps (local_every_n_train_steps)")
    p.add_argument("--local-dir", default=None, help="local tier: the node-local directory of snapshots")
    p.add_argument("--log-level", default=None, help="configure logging at this level (INFO shows the core's lines)")
    p.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL every rank right after this step")
    p.add_argument("--commit-before-kill", action="store_true",
                   help="before the --kill-at-step SIGKILL, wait until the checkpoint and the local snapshot in "
                        "flight are committed")
    p.add_argument("--sigterm-at-step", type=int, default=None, help="SIGTERM every rank right after this step")
    p.add_argument("--sigterm-in-validation", type=int, default=None,
                   help="SIGTERM every rank during the validation that follows this step")
    p.add_argument("--manual", action="store_true", help="manual optimization with two optimizers")
    p.add_argument("--monitor", action="store_true",
                   help="also ModelCheckpoint(monitor='val_loss') and EarlyStopping(monitor='val_loss')")
    p.add_argument("--out", default=None, help="prefix of the loss/summary/weights files")
    p.add_argument("--weights-at-start", action="store_true", help="write OUT.start.pt when training starts")
    p.add_argument("--weights-at-step", type=int, default=None, help="write OUT.step<N>.pt after step N")
    return p.parse_args(argv)


def monitoring_callbacks(args: argparse.Namespace) -> list[Any]:
    """ModelCheckpoint (best 2 by val_loss, under DIRPATH.best/) and EarlyStopping, when ``--monitor`` is given."""
    if not args.monitor:
        return []
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    # beside the checkpoint root, so a resumed run finds the directory its restored state names
    best = ModelCheckpoint(dirpath=f"{args.dirpath}.best", monitor="val_loss", save_top_k=2, filename="{step}")
    return [best, EarlyStopping(monitor="val_loss", patience=3, min_delta=0.2)]


def monitoring_summary(callbacks: list[Any]) -> dict:
    """The restored-or-carried state of ModelCheckpoint and EarlyStopping, as plain numbers."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    out: dict[str, Any] = {}
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint):
            out["best_k"] = sorted((os.path.basename(p), float(v)) for p, v in cb.best_k_models.items())
            out["best_score"] = float(cb.best_model_score)
        elif isinstance(cb, EarlyStopping):
            out["es"] = {"wait": cb.wait_count, "best": float(cb.best_score), "stopped_epoch": cb.stopped_epoch}
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if args.log_level:
        logging.basicConfig(level=args.log_level.upper())
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    model = (TwoOptimizers if args.manual else Regressor)(samples=args.samples, batch_size=args.batch_size, loader=args.loader,
                      num_workers=args.num_workers, val_batches=2 if args.val_every else 0)
    out = args.out
    model.hooks = {
        "losses": f"{out}.losses" if out else None,
        "weights_at_start": f"{out}.start.pt" if out and args.weights_at_start else None,
        "weights_at_step": (args.weights_at_step, f"{out}.step{args.weights_at_step}.pt")
        if out and args.weights_at_step else None,
        "weights_at_end": f"{out}.weights.pt" if out else None,
        "kill_at_step": args.kill_at_step,
        "sigterm_at_step": args.sigterm_at_step,
        "sigterm_in_validation": args.sigterm_in_validation,
    }
    ckpt = DistributedCheckpoint(dirpath=args.dirpath, every_n_train_steps=args.every_n_steps,
                                 keep_last=args.keep_last, async_mode=args.async_mode,
                                 save_on_exception=args.save_on_exception,
                                 local_every_n_train_steps=args.local_every, local_dir=args.local_dir)
    if args.commit_before_kill:
        model.hooks["commit_before_kill"] = ckpt
    callbacks: list[Any] = [ckpt, *monitoring_callbacks(args)]
    strategy: Any = args.strategy
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    logger: Any = False
    if args.csv_logs:
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(args.csv_logs, name="run")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2 if args.val_every else 0,
        val_check_interval=args.val_every or None,
        check_val_every_n_epoch=None if args.val_every else 1,
        num_sanity_val_steps=0,
        accumulate_grad_batches=args.accumulate,
    )
    trainer.fit(model, ckpt_path=args.ckpt_path)
    summary = {"resumed_from": ckpt.resumed_from, "global_step": trainer.global_step,
               "epoch": trainer.current_epoch, **monitoring_summary(callbacks)}
    if out and trainer.is_global_zero:
        with open(f"{out}.json", "w") as f:
            json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
