"""Worker: a save whose storage hangs, waited for in one of the ways a program waits; or a normal exit after saves.

Hang scenarios (``faulty://`` storage that sleeps before every file it opens for
writing): save step 1, print "waiting", then wait for it through ``wait``,
``close``, the interpreter-exit flush (``atexit``) or a preemption save
(``preempt``: ``maybe_save`` every 20 ms until SIGTERM). Before that, another
manager was created and dropped without ``close()``, as notebooks and sweeps
do. The test then sends SIGTERM twice, or Ctrl-C once.

``exit`` scenario: a manager with ``keep_last=1`` saves steps 1 and 2, a second
manager saves step 7 and is dropped; the script ends without ``close()`` or
``wait()`` while both saves may still be writing.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import time

import torch
from torch import nn

from ckpt_core import CheckpointManager, TrainState

_KEEP: list = []  # managers alive at interpreter exit (as a script's globals are)


def _state() -> TrainState:
    torch.manual_seed(0)
    return TrainState(model=nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))


def hang(args: argparse.Namespace) -> None:
    control = lambda **cfg: json.dump(cfg, open(args.control, "w"))  # noqa: E731
    control()
    dropped = CheckpointManager(f"{args.root}/dropped", async_mode=args.mode)
    del dropped
    gc.collect()
    m = CheckpointManager(f"faulty://{args.root}/run", async_mode=args.mode, every_n_steps=1000,
                          storage_options={"control": args.control})
    _KEEP.append(m)
    state = _state()
    control(delay_per_file_s=600)
    if args.scenario == "preempt":
        print("waiting", flush=True)
        step = 0
        while True:
            step += 1
            m.maybe_save(step, state)
            time.sleep(0.02)
    m.save(1, state)
    if args.scenario == "atexit":  # the interpreter's exit flush waits for the save; atexit runs this just before
        atexit.register(print, "waiting", flush=True)
        return
    print("waiting", flush=True)
    if args.scenario == "wait":
        m.wait()
    elif args.scenario == "close":
        m.close()


def normal_exit(args: argparse.Namespace) -> None:
    state = _state()
    m = CheckpointManager(f"{args.root}/run", async_mode=args.mode, keep_last=1, handle_preemption=False)
    _KEEP.append(m)
    m.save(1, state)
    m.wait()
    with torch.no_grad():
        state.model[0].weight.add_(1.0)
    m.save(2, state)
    other = CheckpointManager(f"{args.root}/dropped", async_mode=args.mode, handle_preemption=False)
    other.save(7, state)
    del other
    torch.save(state.model.state_dict(), f"{args.root}/expected.pt")
    print("returned", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--control", default="")
    p.add_argument("--scenario", choices=["wait", "close", "atexit", "preempt", "exit"], required=True)
    p.add_argument("--mode", default="thread")
    args = p.parse_args()
    (normal_exit if args.scenario == "exit" else hang)(args)


if __name__ == "__main__":
    main()
