"""A job that saves its root every step (keep_last=2) until it reaches --steps or is killed; prints what it did.

Exits 7 with the error on stdout when the root's lease is refused (``LeaseHeldError``).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from ckpt_core import CheckpointManager, LeaseHeldError, TrainState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=10**6)
    p.add_argument("--pause", type=float, default=0.05)
    args = p.parse_args()
    torch.manual_seed(0)
    state = TrainState(model=nn.Linear(8, 8), rng=False)
    try:
        m = CheckpointManager(args.root, async_mode="thread", every_n_steps=1, keep_last=2, lease_ttl_s=60.0,
                              handle_preemption=False)
    except LeaseHeldError as e:
        print(f"REFUSED {e}", flush=True)
        raise SystemExit(7)
    info = m.resume(state)
    print(f"resumed {info.step if info else None}", flush=True)
    for step in range(state.step + 1, state.step + 1 + args.steps):
        with torch.no_grad():
            state.model.weight.add_(1.0)
        m.maybe_save(step, state)
        print(f"saved {step}", flush=True)
        time.sleep(args.pause)
    m.close()


if __name__ == "__main__":
    main()
