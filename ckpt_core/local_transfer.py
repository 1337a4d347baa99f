"""Moving snapshots between ranks: point-to-point over the local tier's own gloo group.

A snapshot travels as four messages on one (source, destination) pair: a
header of three int64 (record, data and extra lengths; all zero when the
sender has nothing to send), the record's JSON, the data bytes, the extra
bytes. Every send of a round is posted before any receive, so two ranks that
send to each other never wait on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class Outgoing:
    """A snapshot to send: its record's JSON, data and extra bytes (``record`` empty: nothing to send)."""

    dst: int
    record: bytes = b""
    data: Optional[torch.Tensor] = None
    extra: bytes = b""


@dataclass
class Incoming:
    """A snapshot received from ``src`` (``record`` empty when the sender had none)."""

    src: int
    record: bytes
    data: torch.Tensor
    extra: bytes


def _as_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def post_sends(group: Any, outgoing: Sequence[Outgoing]) -> list[Any]:
    """Start every send (non-blocking); returns the work handles to wait on."""
    works = []
    for out in outgoing:
        data = out.data if out.data is not None else torch.empty(0, dtype=torch.uint8)
        header = torch.tensor([len(out.record), data.numel(), len(out.extra)], dtype=torch.int64)
        works.append(dist.isend(header, out.dst, group=group))
        for part in (_as_tensor(out.record), data, _as_tensor(out.extra)):
            if part.numel():
                works.append(dist.isend(part, out.dst, group=group))
    return works


def receive(group: Any, src: int, alloc: Callable[[bytes, int], torch.Tensor]) -> Incoming:
    """Receive one snapshot from ``src``; ``alloc(record, nbytes)`` gives the byte tensor the data lands in."""
    header = torch.empty(3, dtype=torch.int64)
    dist.recv(header, src, group=group)
    n_record, n_data, n_extra = (int(x) for x in header.tolist())
    record = _recv_bytes(group, src, n_record)
    data = alloc(record, n_data) if n_data else torch.empty(0, dtype=torch.uint8)
    if n_data:
        dist.recv(data, src, group=group)
    return Incoming(src, record, data, _recv_bytes(group, src, n_extra))


def _recv_bytes(group: Any, src: int, n: int) -> bytes:
    if not n:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()


def exchange(group: Any, outgoing: Sequence[Outgoing], sources: Sequence[int],
             alloc: Callable[[int, bytes, int], torch.Tensor]) -> list[Incoming]:
    """One round: send ``outgoing``, receive one snapshot from each of ``sources`` (in order), wait for the sends."""
    works = post_sends(group, outgoing)
    try:
        return [receive(group, src, lambda rec, n, src=src: alloc(src, rec, n)) for src in sources]
    finally:
        for w in works:
            w.wait()
