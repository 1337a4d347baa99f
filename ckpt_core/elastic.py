"""Process-group start-up that survives TorchElastic restarts.

Under ``torchrun --max-restarts``, a restarted worker group reuses the agent's
TCPStore; keys left by the previous attempt (peers' gloo addresses) can be
read before the new peers overwrite them, and ``init_process_group`` then
fails with "connectFullMesh ... Connection refused" or hangs. Prefixing the
store with the attempt number gives every attempt clean keys.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist


def init_process_group(backend: str = "gloo", timeout: Optional[timedelta] = None, **kwargs: Any) -> None:
    """``dist.init_process_group`` from the environment, with a per-attempt store prefix under torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "store" in kwargs:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout or timedelta(minutes=5)))
    store.set_timeout(timeout or timedelta(minutes=5))
    prefixed = dist.PrefixStore(f"/ckpt_attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
