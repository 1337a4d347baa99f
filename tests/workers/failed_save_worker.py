"""Worker: saves that fail on a full storage with ``on_save_error="warn"``, then ``close()``; threads as JSON per rank.

The failed writes leave reference cycles through DCP's frames; once ``close()`` returns, nothing of them may
hold the manager's process groups (whose gloo threads then end while the interpreter is alive). The garbage
collector is off, so that only what ``close()`` frees counts.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from ckpt_core import CheckpointManager, TrainState


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> None:
    root, control, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    gc.disable()
    rank = dist.get_rank()
    state = TrainState(model=torch.nn.Linear(64, 64), rng=False)
    before = threads()
    m = CheckpointManager(f"faulty://{root}", storage_options={"control": control}, async_mode="off",
                          handle_preemption=False, write_retries=0, on_save_error="warn", env={}, argv=[])
    m.save(1, state)
    m.wait()
    dist.barrier()
    if rank == 0:
        with open(control, "w") as f:
            json.dump({"fail_after_bytes": 100}, f)
    dist.barrier()
    m.save(2, state)
    m.wait()
    failed = m.failed_saves
    m.close()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"before": before, "after_close": threads(), "failed_saves": failed}, f)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
