"""Read DCP tensor items straight into the tensors they load into.

DCP's ``FileSystemReader.read_data`` ``torch.load``\\ s every tensor item into a
new tensor and then ``copy_``\\ s it into the load target. That intermediate is
one item (64 MiB for a 64 MiB tensor) on top of the live state and the fresh
buffers a restore loads into, and two items when the restore reshards (the
previous item's tensor is still referenced while the next one loads). Here the
item's archive is opened with ``map_location="meta"`` (its pickle only: dtype,
shape, strides, where the storage bytes lie) and the bytes are read with
``readinto`` into the target's own memory.

The bytes still come through the reader's ``_slice_file``, so whatever the
reader checks there covers them. Items this does not handle (byte items, items
with stream transforms, targets that are not contiguous CPU tensors, saved
tensors that are not contiguous or have another dtype or byte order, regions
that are not one contiguous byte range) are left to DCP's own path.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem


def read_in_place(reader: Any, plan: LoadPlan, planner: LoadPlanner) -> LoadPlan:
    """Read the tensor items of ``plan`` that can go straight into their targets; return the plan of the rest.

    ``reader`` is a DCP ``FileSystemReader`` (or ``FsspecReader``) after
    ``set_up_storage_reader``: its ``fs``, ``path``, ``storage_data`` and
    ``_slice_file`` are used exactly as ``read_data`` uses them.
    """
    rest: list[ReadItem] = []
    per_file: dict[str, list[ReadItem]] = {}
    for req in plan.items:
        sinfo = reader.storage_data[req.storage_index]
        if req.type == LoadItemType.TENSOR and not sinfo.transform_descriptors:
            per_file.setdefault(sinfo.relative_path, []).append(req)
        else:
            rest.append(req)
    for relative_path, reqs in per_file.items():
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, relative_path), "rb") as stream:
            for req in reqs:
                if not _read_item(reader, stream, req, planner):
                    rest.append(req)
    return dataclasses.replace(plan, items=rest)


def _read_item(reader: Any, stream: Any, req: ReadItem, planner: LoadPlanner) -> bool:
    target = planner.resolve_tensor(req).detach()
    if target.device.type != "cpu" or not target.is_contiguous() or tuple(target.shape) != tuple(req.lengths):
        return False
    view = reader._slice_file(stream, reader.storage_data[req.storage_index])
    start = _byte_range(view, req, target)
    if start is None:
        return False
    nbytes = target.numel() * target.element_size()
    if nbytes:
        view.seek(start)
        buf = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        got = 0
        while got < nbytes:
            n = view.readinto(buf[got:])
            if not n:
                raise EOFError(f"item {req.storage_index.fqn} ends after {got} of its {nbytes} bytes")
            got += n
    planner.commit_tensor(req, target)
    return True


def _byte_range(view: Any, req: ReadItem, target: torch.Tensor) -> Optional[int]:
    """Offset in the item's archive where the bytes of the region ``req`` reads start, or None."""
    view.seek(0)
    saved = torch.load(view, map_location="meta", weights_only=True)
    offset, native = _archive_facts(view)
    if (offset is None or not native or not isinstance(saved, torch.Tensor) or saved.dtype != target.dtype
            or not saved.is_contiguous()):
        return None
    shape, starts, lengths = tuple(saved.shape), tuple(req.storage_offsets), tuple(req.lengths)
    if len(starts) != len(shape) or any(s + n > d for s, n, d in zip(starts, lengths, shape)):
        return None
    if not _one_range(shape, lengths):
        return None
    first = (saved.storage_offset() + sum(s * st for s, st in zip(starts, saved.stride()))) * saved.element_size()
    if first + math.prod(lengths) * saved.element_size() > saved.untyped_storage().nbytes():
        return None  # the pickle's shape does not fit its storage: let torch.load report it
    return offset + first


def _one_range(shape: tuple, lengths: tuple) -> bool:
    """Whether a region of ``lengths`` in a contiguous tensor of ``shape`` is one contiguous byte range.

    It is when it has length 1 in every dimension before the last one it does
    not span whole (the later ones it spans whole): rows ``a..b`` of a matrix
    are, columns ``a..b`` of several rows are not.
    """
    partial = [i for i, (n, d) in enumerate(zip(lengths, shape)) if n != d]
    if not partial or math.prod(lengths) == 0:
        return True
    return all(n == 1 for n in lengths[: partial[-1]])


def _archive_facts(view: Any) -> tuple[Optional[int], bool]:
    """Where the archive's only storage record starts (None unless there is exactly one), and whether the
    archive's byte order is this machine's (``torch.load`` would swap the bytes otherwise)."""
    view.seek(0)
    zf = torch._C.PyTorchFileReader(view)
    records = zf.get_all_records()
    data = [r for r in records if r.startswith("data/")]
    order = [r for r in records if r == "byteorder" or r.endswith("/byteorder")]
    native = bytes(zf.get_record(order[0])).decode() == sys.byteorder if order else sys.byteorder == "little"
    return (zf.get_record_offset(data[0]) if len(data) == 1 else None), native
