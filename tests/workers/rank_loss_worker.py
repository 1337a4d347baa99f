"""One rank of a job launched without torchrun (each rank its own process, as on separate nodes).

scenario=save: commit step 10, then rank 1 stops (SIGSTOP) or kills its whole process group, its writer
    process included (a node that hangs or dies), while step 20 is being written.
scenario=restore: commit step 10, then rank 1 stops or kills its process group while step 10 is read back.
Every surviving rank prints ``LOST <seconds since the fault> <message>`` and exits 3 on ``RankLostError``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from ckpt_core import CheckpointManager, RankLostError, TrainState


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--scenario", choices=["save", "restore"], required=True)
    p.add_argument("--fault", choices=["stop", "kill"], default="stop")
    p.add_argument("--mode", default="process")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    state = TrainState(model=nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), rng=False)
    control = f"{args.root}.faults-{rank}.json"
    json.dump({}, open(control, "w"))
    opts = dict(async_mode=args.mode, collective_timeout_s=5.0, storage_options={"control": control},
                handle_preemption=False, env={}, argv=[])
    m = CheckpointManager(f"faulty://{args.root}", **opts)
    m.save(10, state)
    m.wait()
    print("committed 10", flush=True)
    slow = {"delay_per_file_s": 1.0} if args.scenario == "save" else {"delay_per_read_s": 0.5}
    json.dump(slow, open(control, "w"))
    sig = signal.SIGSTOP if args.fault == "stop" else signal.SIGKILL
    t_fault = time.time() + (0.3 if args.scenario == "save" else 1.0)
    if rank == 1:
        threading.Timer(t_fault - time.time(), os.killpg, (0, sig)).start()
    try:
        if args.scenario == "save":
            m.save(20, state)
            m.wait()
        else:
            m.close()
            CheckpointManager(f"faulty://{args.root}", **opts).restore(state)
        print("finished without the fault", flush=True)
    except RankLostError as e:
        print(f"LOST {time.time() - t_fault:.1f} {e}", flush=True)
        raise SystemExit(3)


if __name__ == "__main__":
    main()
