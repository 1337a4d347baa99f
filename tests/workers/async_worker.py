"""Worker for background-write scenarios in DCP's checkpoint process (a real spawned process).

scenario=kill: save step 10 and wait; start a slow background save of step 20; SIGKILL
    this process while it is writing.
scenario=diskfull: save 10; the storage then fails with ENOSPC; the save of step 20 fails in
    the background; on_save_error decides; storage is freed; step 30 saves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch import nn

from ckpt_core import CheckpointManager, SaveError, TrainState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--scenario", choices=["kill", "diskfull"], required=True)
    p.add_argument("--on-save-error", default="raise")
    p.add_argument("--mode", default="process")
    p.add_argument("--kill-group", action="store_true", help="kill the writer process too (a node failure)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    state = TrainState(model=model)
    control = lambda **cfg: json.dump(cfg, open(args.control, "w"))  # noqa: E731
    control()
    m = CheckpointManager(args.root, async_mode=args.mode, on_save_error=args.on_save_error,
                          storage_options={"control": args.control}, retry_backoff_s=0.01)
    m.save(10, state)
    m.wait()
    print("committed 10", flush=True)
    if args.scenario == "kill":
        control(delay_per_file_s=1.5)
        m.save(20, state)
        time.sleep(0.5)
        print("killing during the background write", flush=True)
        if args.kill_group:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    control(fail_after_bytes=50_000)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    m.save(20, state)
    try:
        m.wait()
        print("wait returned", flush=True)
    except SaveError as e:
        print(f"SAVE ERROR step={e.step}: {e}", flush=True)
        raise SystemExit(3)
    control()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    m.save(30, state)
    m.close()
    print("committed 30", flush=True)


if __name__ == "__main__":
    main()
