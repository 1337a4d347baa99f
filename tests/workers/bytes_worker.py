"""Worker: FSDP2 training saved at one step in thread mode and in bytes mode, then restored from the bytes save.

Each rank writes ``results/rank<r>.txt``: ``exact`` (or ``differ``) for the restored model and optimizer
state against the state saved, and the pid of its byte writer process.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from ckpt_core import CheckpointManager, TrainState, byte_client


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 256))
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, entries in osd["state"].items():
        out.update({f"optim.{fqn}.{k}": t.clone() for k, t in entries.items()})
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, root = dist.get_rank(), sys.argv[1]
    model, opt = build(0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(8, 512, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    expected = full(model, opt)
    for mode in ("thread", "bytes"):
        with CheckpointManager(f"{root}/{mode}", async_mode=mode, lease=False, handle_preemption=False) as m:
            m.save(3, TrainState(model=model, optimizers=opt))
            m.wait()
    pid = byte_client.PROCESS.pid
    fresh, fresh_opt = build(7)
    with CheckpointManager(f"{root}/bytes", async_mode="off", lease=False, handle_preemption=False) as m:
        assert m.restore(TrainState(model=fresh, optimizers=fresh_opt)).step == 3
    got = full(fresh, fresh_opt)
    same = got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    os.makedirs(f"{root}/results", exist_ok=True)
    with open(f"{root}/results/rank{rank}.txt", "w") as f:
        f.write(f"{'exact' if same else 'differ'} {pid}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
