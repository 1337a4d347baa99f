"""State fingerprints: per-tensor sums (accumulated in float64) over the full logical tensors.

A fingerprint is computed while the checkpoint is written (from the staged
copy, in the background) and again after a restore; comparing the two catches
a load that silently went wrong. Non-finite sums mark a state unhealthy.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import numpy as np
import torch

from .array_sums import CHUNK as _CHUNK, sums_crc

Entry = tuple[float, float, int]
"""(sum, sum of absolute values, number of elements), all over the logical tensor."""

FINGERPRINT_PREFIXES = ("model.", "optim.")


def is_fingerprinted(fqn: str) -> bool:
    """Model parameters/buffers and optimizer state are fingerprinted; RNG and data position are not."""
    return fqn.startswith(FINGERPRINT_PREFIXES)


_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def tensor_entry(t: torch.Tensor, intra_op: bool = False) -> Entry:
    """(sum, sum of |x|, numel) of ``t``; CPU floating tensors in cache-sized blocks.

    A float32 block of 2^18 elements is laid out as 64 rows of 4096 and
    summed down its columns in float32 (vector adds across a row, 64 values
    per column: relative error ~4e-11 of the sum of |x| on random data, far
    inside the comparison's 1e-6), the 4096 column sums in float64: 0.085 s
    of CPU per GiB, against 0.12 s for pairwise row sums and 0.39 s for a
    float64 pass (2-core x86-64, one thread, data in memory). A column sum
    that overflows float32 is recomputed in float64, so a sum is non-finite
    only when a value is, as with a float64 pass. That runs in numpy, on the
    calling thread only: a background save does not fight training for every
    core (torch's intra-op threads stall on a busy machine).

    ``intra_op``: for a restore, where nothing else runs: each block summed
    by torch (cascade sums in float32, float64 for float64 tensors) on its
    intra-op threads, the blocks added in float64 (``_torch_sums``): 1 GiB in
    0.10 s against 0.21 s on the 2-core machine of docs/benchmarks.md.
    """
    if t.numel() == 0:
        return (0.0, 0.0, 0)
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.detach().reshape(-1)
    floating = _numpy_summed(flat.dtype)
    if flat.device.type == "cpu" and floating and intra_op:
        s, sa = _torch_sums(flat.resolve_neg())
        return (s, sa, int(t.numel()))
    if flat.device.type == "cpu" and floating:
        s, sa = _numpy_sums(_numpy_view(flat.resolve_neg()))
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


def crc_fusable(t: torch.Tensor) -> bool:
    """Whether ``entry_and_crc`` takes ``t``'s CRC32C while summing it: a non-empty contiguous CPU tensor of
    a dtype summed in numpy, whose summed bytes are its own (no pending negation or conjugation)."""
    return (_numpy_summed(t.dtype) and t.device.type == "cpu" and t.numel() > 0 and t.is_contiguous()
            and not t.is_neg() and not t.is_conj())


def entry_and_crc(t: torch.Tensor, crc: bool = True) -> tuple[Entry, Optional[int]]:
    """``tensor_entry(t)`` and, with ``crc`` where ``crc_fusable(t)``, the CRC32C of ``t``'s bytes in memory
    order (else None).

    Each block's CRC is taken right after the block is summed, while it is in
    the CPU's cache: 0.04 s per GiB on top of the sums, against 0.07 s for a
    CRC32C pass of its own over memory (2-core x86-64 of docs/benchmarks.md).
    A background save hands it to its writer (``staged_crc``).
    """
    if not (crc and crc_fusable(t)):
        return tensor_entry(t), None
    s, sa, c = sums_crc(_numpy_view(t.detach().reshape(-1)))
    return (s, sa, int(t.numel())), c


def _numpy_summed(dtype: torch.dtype) -> bool:
    """Whether a CPU tensor of ``dtype`` is summed in numpy (float16/32/64, bfloat16 as its bits)."""
    return dtype in _NUMPY_DTYPES or dtype == torch.bfloat16


def _numpy_view(flat: torch.Tensor) -> np.ndarray:
    """A flat CPU tensor of a dtype summed in numpy, as numpy sees it (bfloat16 as its uint16 bits)."""
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


def _torch_sums(flat: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of |x|) of a flat CPU floating tensor: blocks of ``_CHUNK`` summed by torch in float32 (float64
    for float64), added in float64; a block whose float32 sums overflow while its values are finite is summed
    again in float64, as ``array_sums.block_sum`` does."""
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    buf = torch.empty(min(flat.numel(), _CHUNK), dtype=flat.dtype)
    s = sa = 0.0
    for chunk in flat.split(_CHUNK):
        absolute = torch.abs(chunk, out=buf[: chunk.numel()])
        cs, ca = float(chunk.sum(dtype=wide)), float(absolute.sum(dtype=wide))
        if not (math.isfinite(cs) and math.isfinite(ca)) and bool(torch.isfinite(chunk).all()):
            cs, ca = float(chunk.sum(dtype=torch.float64)), float(absolute.sum(dtype=torch.float64))
        s += cs
        sa += ca
    return s, sa


def _numpy_sums(a: np.ndarray) -> tuple[float, float]:
    """(sum, sum of |x|) of a flat float16/32/64 array, or of bfloat16 bits held as uint16."""
    s, sa, _ = sums_crc(a, with_crc=False)
    return s, sa


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


def local_entries(flat: Mapping[str, object], rank: int, intra_op: bool = False,
                  known: Optional[Mapping[str, Entry]] = None, summed: Optional[dict[str, Entry]] = None
                  ) -> dict[str, Entry]:
    """This rank's contribution to the fingerprint of a flattened state dict.

    DTensor shards contribute their local part (divided among replicas);
    plain tensors are replicated, so only rank 0 contributes them
    (``local_jobs``). ``intra_op``: sum with torch on its intra-op threads
    (``tensor_entry``): for a restore, when no training shares the cores.
    ``known``: entries of local tensors (a DTensor's local shard) already
    summed, taken instead of summing them again; ``summed`` receives the
    entry of every local tensor that contributed, summed or known.
    """
    jobs = local_jobs(flat, rank)
    out: dict[str, Entry] = {fqn: (0.0, 0.0, 0) for fqn, value in flat.items()
                             if is_fingerprinted(fqn) and isinstance(value, torch.Tensor) and fqn not in jobs}
    known = known or {}
    done = [(fqn, known[fqn], jobs[fqn][1]) for fqn in jobs if fqn in known]
    done += _entries({fqn: job for fqn, job in jobs.items() if fqn not in known}, intra_op)
    for fqn, (s, a, n), replicas in done:
        if summed is not None:
            summed[fqn] = (s, a, n)
        out[fqn] = (s / replicas, a / replicas, n / replicas) if replicas > 1 else (s, a, n)  # type: ignore
    return out


def local_jobs(flat: Mapping[str, object], rank: int) -> dict[str, tuple[torch.Tensor, int]]:
    """What this rank sums of a flattened state dict: name -> (the local tensor, its number of replicas).
    A DTensor's local shard on every rank; a plain tensor (replicated) on rank 0 only."""
    from torch.distributed.tensor import DTensor

    jobs: dict[str, tuple[torch.Tensor, int]] = {}
    for fqn, value in flat.items():
        if not is_fingerprinted(fqn) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            replicas = 1
            for dim, placement in enumerate(value.placements):
                if placement.is_replicate():
                    replicas *= value.device_mesh.size(dim)
            jobs[fqn] = (value.to_local(), replicas)
        elif rank == 0:
            jobs[fqn] = (value, 1)
    return jobs


def group_rank(group: Optional[object] = None) -> int:
    """This process's rank in ``group`` (0 when not distributed), as ``global_entries`` counts it."""
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _entries(jobs: Mapping[str, tuple[torch.Tensor, int]], intra_op: bool) -> list:
    """``(fqn, tensor_entry, replicas)`` of every job."""
    return [(fqn, tensor_entry(t, intra_op), r) for fqn, (t, r) in jobs.items()]


def global_entries(flat: Mapping[str, object], group: Optional[object] = None, intra_op: bool = False,
                   known: Optional[Mapping[str, Entry]] = None, summed: Optional[dict[str, Entry]] = None
                   ) -> dict[str, Entry]:
    """Fingerprint of the full logical state, all-reduced over ``group`` when distributed (``local_entries``'s
    ``intra_op``, ``known`` and ``summed``)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    local = local_entries(flat, group_rank(group), intra_op, known, summed)
    if not distributed or dist.get_world_size(group) == 1:
        return local
    keys = sorted(local)
    buf = torch.tensor([[*local[k]] for k in keys], dtype=torch.float64).reshape(len(keys), 3)
    dist.all_reduce(buf, group=group)
    return {k: (float(buf[i, 0]), float(buf[i, 1]), int(round(float(buf[i, 2])))) for i, k in enumerate(keys)}
