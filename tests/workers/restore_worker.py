"""Worker: restore the newest valid checkpoint under --root (the integrity tests' state) and report the step per rank."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt_core import CheckpointManager, TrainState  # noqa: E402
from helpers_ckpt import tiny_model  # noqa: E402


class Box:
    def __init__(self) -> None:
        self.value = None

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    model = tiny_model(99)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizers=opt, extra={"box": Box()})
    with CheckpointManager(args.root, async_mode="off", handle_preemption=False) as manager:
        info = manager.restore(state)
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump({"step": None if info is None else info.step, "state_step": state.step}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
