"""Fingerprint entries of the tensors a load fills, summed on one thread while the load still reads.

A restore checks the loaded tensors against the saved fingerprint
(``fingerprint``). Summing them only after the load leaves the cores idle
while the disk works and adds a pass over the whole state to the restore.
Here the reading threads (``inplace_read``) report each piece of a region
as it lands in its tensor (``read``) and each item once it was checked and
placed (``filled``); one background thread sums the pieces in that order
(numpy on that thread alone, as a save's fingerprint is summed: torch's
intra-op threads, which fight the reading threads for the cores, left a
longer tail on the 2-core machine of docs/benchmarks.md), adds an item's
regions to their tensors' entries once the item is filled, and closes a
tensor's entry when every read request that fills it is in.
The restorer takes these entries as already known and sums only the rest
after the load; what was summed early is at most the last piece of each
reading thread away from done when the reads end.

A tensor is summed early only when nothing else of the load writes into its
bytes: its requests are all the plan's requests for its name, it is a
contiguous CPU tensor, its bytes overlap no other tensor summed here (tied
weights, views of one flat buffer), and every region reported lies inside
it. Its regions' sums make its entry when they tile it exactly; otherwise
the whole tensor is summed once its last request is in. A request left to
DCP's own path never reports in, so its tensor is summed after the load. A
failure while summing drops every early entry: all are summed after the
load, as without this.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable, Iterable, Mapping

import torch

from . import fingerprint as fp


class EarlySums:
    """Entries of the tensors ``tensors`` (name -> the local tensor its fingerprint entry is taken over).

    ``expect`` is called before the reads start, ``read`` and ``filled`` from the reading threads (a region's
    pieces in order, from one thread), ``entries`` or ``close`` once they are done.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = {k: t for k, t in tensors.items() if _summable(t)}
        self._left: dict[str, int] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._broken = False
        # the summing thread's own state
        self._regions: dict[int, list] = {}  # id(region tensor) -> [sum, sum of |x|, elements, bytes summed]
        self._parts: dict[str, list] = collections.defaultdict(list)  # name -> [(address, bytes, entry)]
        self._done: dict[str, fp.Entry] = {}

    def expect(self, names: Iterable[str]) -> None:
        """The load's plan: the destination name of each of its read requests (one per request)."""
        counts = collections.Counter(names)
        wanted = {k: t for k, t in self._tensors.items() if counts[k]}
        overlapping = _overlapping(wanted)
        self._left = {k: counts[k] for k in wanted if k not in overlapping}
        if self._left:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "ckpt-sum")

    def read(self, name: str, region: torch.Tensor, upto: int) -> None:
        """The first ``upto`` bytes of ``region`` (the contiguous part of tensor ``name`` that one request
        fills) are in: sum those not summed yet."""
        if name in self._left:
            self._submit(self._sum_region, region, upto)

    def filled(self, regions: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The item holding these ``(name, region)``\\ s was read, checked and placed."""
        for name, region in regions:
            if name in self._left:
                self._submit(self._close_region, name, region)

    def entries(self) -> dict[str, fp.Entry]:
        """The entries summed (waits for the summing thread to finish); none after a failure while summing."""
        self._shut(cancel=False)
        return {} if self._broken else dict(self._done)

    def close(self) -> None:
        """Stop summing (what is queued is dropped) and end the thread."""
        self._shut(cancel=True)

    def _shut(self, cancel: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._pool is not None:
            self._pool.submit(self._guarded, fn, *args)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        if self._broken:
            return
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - every early entry is dropped; the pass after the load sums them
            self._broken = True

    # ------------------------------------------------------------ on the summing thread
    def _sum_region(self, region: torch.Tensor, upto: int) -> None:
        acc = self._regions.setdefault(id(region), [0.0, 0.0, 0, 0])
        size = region.element_size()
        start, end = acc[3] // size, upto // size
        if end > start:
            s, sa, n = fp.tensor_entry(region.reshape(-1)[start:end])
            acc[0], acc[1], acc[2], acc[3] = acc[0] + s, acc[1] + sa, acc[2] + n, end * size

    def _close_region(self, name: str, region: torch.Tensor) -> None:
        self._sum_region(region, _nbytes(region))
        s, sa, n, _ = self._regions.pop(id(region))
        self._parts[name].append((region.data_ptr(), _nbytes(region), (s, sa, n)))
        self._left[name] -= 1
        if self._left[name] == 0:
            self._done[name] = self._entry(name)

    def _entry(self, name: str) -> fp.Entry:
        """Tensor ``name``'s entry: its regions' sums where they tile it exactly, else the whole tensor summed."""
        tensor, parts = self._tensors[name], sorted(self._parts.pop(name), key=lambda p: p[0])
        start, end = tensor.data_ptr(), tensor.data_ptr() + _nbytes(tensor)
        edges = [start] + [a + n for a, n, _ in parts]
        if any(a < start or a + n > end for a, n, _ in parts):
            raise ValueError(f"a region of {name} lies outside it")  # not loaded into it directly: no early sums
        if [a for a, _, _ in parts] != edges[:-1] or edges[-1] != end:
            return fp.tensor_entry(tensor)
        return fp.combine({name: e} for _, _, e in parts)[name]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _summable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided \
        and not t.is_quantized and t.is_contiguous() and t.numel() > 0


def _overlapping(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    """The names of tensors whose bytes overlap another's."""
    spans = sorted((t.data_ptr(), t.data_ptr() + _nbytes(t), k) for k, t in tensors.items())
    out: set[str] = set()
    reach, owner = -1, ""
    for start, end, name in spans:
        if start < reach:
            out.update((name, owner))
        if end > reach:
            reach, owner = end, name
    return out
