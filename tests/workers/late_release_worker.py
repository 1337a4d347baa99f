"""Worker: a script whose last collective is released by gloo's worker thread only after the script has ended.

The group outlives ``destroy_process_group()`` (a reference is kept, as FSDP2 and DTensor keep one), the
collective's tensors and work are dropped at once, and the main thread never hands the GIL over while it
runs Python: the worker that finishes the all-gather can free its tensors only once the main thread sleeps.
``--with-library`` imports ``ckpt_core`` (its exit hooks); without it the process aborts during finalization.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

if "--with-library" in sys.argv:
    import ckpt_core.manager  # noqa: F401 - registers the library's exit hooks

if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
kept = dist.group.WORLD
sys.setswitchinterval(1000.0)
world = dist.get_world_size()
dist.all_gather_coalesced([[torch.empty(1 << 20)] for _ in range(world)], [torch.ones(1 << 20)], async_op=True)
start = time.perf_counter()
while time.perf_counter() - start < 0.3:  # the all-gather finishes meanwhile; its worker waits for the GIL
    pass
dist.destroy_process_group()
print("end of script", flush=True)
