"""Worker: what ``fix_bucket_layout`` does to real DDP instances (2 ranks, gloo); writes facts as JSON per rank."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from ckpt_core.ddp_layout import fix_bucket_layout


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])


def rebuilt_order(ddp: nn.parallel.DistributedDataParallel) -> str:
    x = torch.ones(2, 64)
    for _ in range(3):
        ddp(x).sum().backward()
    return ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")


def main() -> None:
    dist.init_process_group("gloo")
    facts: dict = {}
    plain = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.02)
    facts["natural_order"] = rebuilt_order(plain)

    ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.02)
    before = [p.detach().clone() for p in ddp.parameters()]
    first = next(ddp.parameters())
    first.grad = torch.full_like(first, 7.0)
    rng = torch.get_rng_state()
    facts["primed"] = fix_bucket_layout(nn.ModuleDict({"wrapped": ddp}))
    facts["primed_again"] = fix_bucket_layout(ddp)
    facts["params_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    facts["grads_kept"] = torch.equal(first.grad, torch.full_like(first, 7.0)) and all(
        p.grad is None for p in list(ddp.parameters())[1:])
    facts["rng_unchanged"] = torch.equal(rng, torch.get_rng_state())
    first.grad = None
    facts["primed_order"] = rebuilt_order(ddp)

    trained = nn.parallel.DistributedDataParallel(model())
    trained(torch.ones(2, 64)).sum().backward()
    facts["after_a_step"] = fix_bucket_layout(trained)
    facts["find_unused"] = fix_bucket_layout(nn.parallel.DistributedDataParallel(model(), find_unused_parameters=True))
    with open(f"{sys.argv[1]}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
