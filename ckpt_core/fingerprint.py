"""State fingerprints: per-tensor float64 sums over the full logical tensors.

A fingerprint is computed while the checkpoint is written (from the staged
copy, in the background) and again after a restore; comparing the two catches
a load that silently went wrong. Non-finite sums mark a state unhealthy.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import numpy as np
import torch

Entry = tuple[float, float, int]
"""(sum, sum of absolute values, number of elements), all over the logical tensor."""

FINGERPRINT_PREFIXES = ("model.", "optim.")


def is_fingerprinted(fqn: str) -> bool:
    """Model parameters/buffers and optimizer state are fingerprinted; RNG and data position are not."""
    return fqn.startswith(FINGERPRINT_PREFIXES)


_CHUNK = 1 << 20
"""Elements per float64 chunk: 8 MiB of scratch, whatever the tensor's size."""
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def tensor_entry(t: torch.Tensor) -> Entry:
    if t.numel() == 0:
        return (0.0, 0.0, 0)
    if t.is_complex():
        t = torch.view_as_real(t)
    # Chunk by chunk, never a float64 (and abs) copy of the whole tensor: that cost 4x the tensor's size
    # in transient memory and ~2 s per GiB, mostly page faults (see benchmarks/save.py).
    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.dtype in _NUMPY_DTYPES:
        # numpy reduces on one thread: a background save does not fight training for every core
        # (torch's intra-op threads stall on a busy machine).
        a = flat.resolve_neg().numpy()
        buf = np.empty(min(a.size, _CHUNK), dtype=a.dtype)
        s = sa = 0.0
        with np.errstate(all="ignore"):  # non-finite sums are data here (an unhealthy state), not errors
            for i in range(0, a.size, _CHUNK):
                c = a[i : i + _CHUNK]
                s += float(np.add.reduce(c, dtype=np.float64))
                sa += float(np.add.reduce(np.abs(c, out=buf[: c.size]), dtype=np.float64))
        return (s, sa, int(t.numel()))
    buf_t = torch.empty(min(flat.numel(), _CHUNK), dtype=torch.float64, device=flat.device)
    acc = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for chunk in flat.split(_CHUNK):
        b = buf_t[: chunk.numel()]
        b.copy_(chunk)
        acc[0] += b.sum()
        acc[1] += b.abs_().sum()
    s, sa = acc.tolist()
    return (s, sa, int(t.numel()))


def combine(parts: Iterable[Mapping[str, Entry]]) -> dict[str, Entry]:
    """Add up partial entries (one per shard/rank) into full-tensor entries."""
    out: dict[str, list] = {}
    for part in parts:
        for k, (s, a, n) in part.items():
            acc = out.setdefault(k, [0.0, 0.0, 0])
            acc[0] += s
            acc[1] += a
            acc[2] += n
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def _close(x: float, y: float, scale: float, rtol: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= rtol * max(scale, 1e-30) + 1e-12


def compare(expected: Mapping[str, Entry], actual: Mapping[str, Entry], rtol: float = 1e-6) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match).

    The tolerance absorbs float64 summation order (a resharded tensor is summed
    in other chunks); it is relative to the sum of absolute values.
    """
    problems = []
    for k in sorted(set(expected) - set(actual)):
        problems.append(f"{k}: in the checkpoint but not restored")
    for k in sorted(set(actual) - set(expected)):
        problems.append(f"{k}: restored but not in the checkpoint's fingerprint")
    for k in sorted(set(expected) & set(actual)):
        (s0, a0, n0), (s1, a1, n1) = expected[k], actual[k]
        scale = max(a0, a1) if math.isfinite(max(a0, a1)) else 1.0
        if n0 != n1:
            problems.append(f"{k}: {n1} elements restored, {n0} saved")
        elif not (_close(s0, s1, scale, rtol) and _close(a0, a1, scale, rtol)):
            problems.append(f"{k}: sum {s1!r} (abs {a1!r}) restored, {s0!r} (abs {a0!r}) saved")
    return problems


def local_entries(flat: Mapping[str, object], rank: int) -> dict[str, Entry]:
    """This rank's contribution to the fingerprint of a flattened state dict.

    DTensor shards contribute their local part (divided among replicas);
    plain tensors are replicated, so only rank 0 contributes them.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, Entry] = {}
    for fqn, value in flat.items():
        if not is_fingerprinted(fqn) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            replicas = 1
            for dim, placement in enumerate(value.placements):
                if placement.is_replicate():
                    replicas *= value.device_mesh.size(dim)
            s, a, n = tensor_entry(value.to_local())
            out[fqn] = (s / replicas, a / replicas, n / replicas)  # type: ignore[assignment]
        elif rank == 0:
            out[fqn] = tensor_entry(value)
        else:
            out[fqn] = (0.0, 0.0, 0)
    return out


def global_entries(flat: Mapping[str, object], group: Optional[object] = None) -> dict[str, Entry]:
    """Fingerprint of the full logical state, all-reduced over ``group`` when distributed."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    local = local_entries(flat, rank)
    if not distributed or dist.get_world_size(group) == 1:
        return local
    keys = sorted(local)
    buf = torch.tensor([[*local[k]] for k in keys], dtype=torch.float64).reshape(len(keys), 3)
    dist.all_reduce(buf, group=group)
    return {k: (float(buf[i, 0]), float(buf[i, 1]), int(round(float(buf[i, 2])))) for i, k in enumerate(keys)}
