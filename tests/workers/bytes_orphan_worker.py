"""Worker: save once in bytes mode, fork a child that holds every descriptor (a data-loader worker would),
print both pids, then die by SIGKILL: the byte writer must exit although its socket is still open."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from ckpt_core import CheckpointManager, TrainState, byte_client


def main() -> None:
    model = torch.nn.Linear(256, 256)
    manager = CheckpointManager(sys.argv[1], async_mode="bytes", lease=False, handle_preemption=False)
    manager.save(1, TrainState(model=model))
    manager.wait()
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # the test reads this script's output to its end
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    print(byte_client.PROCESS.pid, child, torch.distributed.is_initialized(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
