"""RNG state capture and restore, as tensors only (loads with ``weights_only=True``).

Each rank saves its own generators: python ``random``, numpy's global
generator, torch CPU and every CUDA device. At the same world size each rank
gets its own state back (bit-exact). At a different world size the policy is
``remap_rng_source``: rank r takes the state saved by rank ``r % saved_world``,
and ranks beyond the saved world additionally advance every generator by a
rank-derived amount so that no two ranks share a stream.
"""

from __future__ import annotations

import random
from typing import Optional

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]


def capture() -> dict[str, torch.Tensor]:
    """This process's generators as a dict of CPU tensors."""
    version, mt, gauss = random.getstate()
    out = {
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        assert kind == "MT19937"
        out["numpy"] = torch.from_numpy(keys.astype(np.int64))
        out["numpy_meta"] = torch.tensor([pos, has_gauss, 0], dtype=torch.int64)
        out["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda_{i}"] = state
    return out


def apply(state: dict[str, torch.Tensor]) -> None:
    """Set this process's generators from ``capture()`` output."""
    values = state["python"].tolist()
    gauss = float(state["python_gauss"][0])
    random.setstate((int(values[0]), tuple(int(v) for v in values[1:]), None if gauss != gauss else gauss))
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if np is not None and "numpy" in state:
        pos, has_gauss, _ = (int(v) for v in state["numpy_meta"].tolist())
        keys = state["numpy"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, pos, has_gauss, float(state["numpy_gauss"][0])))
    cuda_keys = sorted(k for k in state if k.startswith("cuda_"))
    if cuda_keys and torch.cuda.is_available():
        n = torch.cuda.device_count()
        for k in cuda_keys:
            i = int(k.split("_")[1])
            if i < n:
                torch.cuda.set_rng_state(state[k].to(torch.uint8).cpu(), device=i)


def remap_rng_source(rank: int, saved_world_size: int) -> tuple[int, int]:
    """Which saved rank's state rank ``rank`` resumes from, and how far to advance it.

    Pure policy, documented in docs/core.md: rank r takes saved rank
    ``r % saved_world_size``; ``r // saved_world_size`` (0 for ranks that
    existed before) is the number of decorrelating draws applied.
    """
    if saved_world_size <= 0:
        raise ValueError(f"saved_world_size must be positive, got {saved_world_size}")
    return rank % saved_world_size, rank // saved_world_size


def decorrelate(times: int) -> None:
    """Advance every generator deterministically ``times`` rounds (a no-op for 0)."""
    for _ in range(times):
        salt = random.getrandbits(63)
        random.seed(salt)
        torch.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) ^ salt)
        if np is not None:
            np.random.seed(int(np.random.randint(0, 2**31 - 1)) ^ (salt & 0x7FFFFFFF))


def template(example: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like ``capture()`` output, for DCP to load into."""
    example = capture() if example is None else example
    return {k: torch.empty_like(v) for k, v in example.items()}
