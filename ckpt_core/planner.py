"""DCP's save planner with a global step that stays linear in the rank count and a cheap local step.

``DefaultSavePlanner._create_global_plan`` merges the ranks' ``planner_data``
with ``dict(ChainMap(*mappings))``: each key is looked up through the mappings
in order, and ``TrainState`` gives every rank a key of its own (``ranks.<r>``),
so rank r's key passes r mappings: quadratic in the rank count (0.82 s at
2,048 ranks, 2 to 3 s at 4,096; ``benchmarks/scale.py``). The same merge with
``dict.update`` (first mapping wins, as in the ``ChainMap``) is linear.

The local plan of every save places each DTensor's shard with torch's
``compute_local_shape_and_global_offset``, which builds an int64 index of the
shard's length along each sharded dimension (``torch.arange``): for a 1-D
parameter sharded on dim 0, twice the shard's bytes, allocated and written at
every save (0.4 s of CPU per GiB of such shards in the writer, most of it page
faults, and at the first save a peak of that index's size: 0.23x a rank's
256 MiB of 32 MiB shards). For placements that are all ``Shard`` or
``Replicate``, ``shard_place`` computes the same place from integers alone;
other placements (``_StridedShard``) go to torch. Either way the place only
depends on the tensor's layout, so it is computed once per layout and process
(``shard_chunk``). A load plans its reads from the same place (DTensor's
``__create_chunk_list__`` calls torch's function too: 0.035 s per 1-D shard of
16M elements, 0.7 s of a 2-rank restore of 16 such parameters on the 2-core
machine of docs/benchmarks.md): ``placed_for_load`` stands in for each DTensor
while DCP's default load planner builds the local plan.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_CHUNKS: dict[tuple, tuple[torch.Size, torch.Size]] = {}
_CHUNKS_LOCK = threading.Lock()
_CHUNKS_MAX = 1 << 16


def merge_planner_data(mappings: list[dict]) -> dict:
    """``dict(ChainMap(*mappings))`` in one pass: for a key in several mappings the first one's value wins."""
    merged: dict = {}
    for mapping in reversed(mappings):
        merged.update(mapping)
    return merged


def shard_place(global_shape: tuple, mesh_shape: tuple, coordinate: tuple,
                placements: tuple) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(sizes, offsets) of the shard at ``coordinate`` of a mesh of ``mesh_shape``, as torch's
    ``compute_local_shape_and_global_offset`` gives them, for placements that are all ``Shard`` or
    ``Replicate``; None for any other placement.

    Mesh dimensions split the tensor in order, each as ``torch.chunk`` does
    (chunks of ``ceil(size / n)``, the last ones shorter or empty); a shard's
    offset along a dimension is the sum of its chunks' offsets, and an empty
    shard's offset is the dimension's global size, as torch reports it.
    """
    sizes, offsets = list(global_shape), [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard or not 0 <= placement.dim < len(sizes):
            return None
        d, n, rank = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        chunk = -(-sizes[d] // n)
        start = min(sizes[d], chunk * rank)
        sizes[d] = max(0, min(sizes[d], start + chunk) - start)
        offsets[d] = offsets[d] + start if sizes[d] else global_shape[d]
    return tuple(sizes), tuple(offsets)


def shard_chunk(tensor: DTensor) -> tuple[torch.Size, torch.Size]:
    """(sizes, offsets) of this rank's shard of ``tensor``, as DCP's ``compute_local_shape_and_global_offset``
    gives them; computed once per (global shape, mesh, placements, this rank's coordinate) in a process."""
    mesh = tensor.device_mesh
    placements, coordinate = tuple(tensor.placements), tuple(mesh.get_coordinate() or ())
    key = (tuple(tensor.shape), mesh, placements, coordinate)
    with _CHUNKS_LOCK:
        hit = _CHUNKS.get(key)
    if hit is not None:
        return hit
    place = shard_place(tuple(tensor.shape), tuple(mesh.shape), coordinate, placements)
    sizes, offsets = place or compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    hit = (torch.Size(sizes), torch.Size(offsets))
    with _CHUNKS_LOCK:
        if len(_CHUNKS) >= _CHUNKS_MAX:
            _CHUNKS.clear()
        _CHUNKS[key] = hit
    return hit


def dtensor_write_item(fqn: str, tensor: DTensor) -> Optional[WriteItem]:
    """The write item DCP plans for a DTensor over a plain local tensor, its place from ``shard_chunk``;
    None for what DCP plans another way (partial placements, a local tensor of another subclass)."""
    if not _plain_shard(tensor):
        return None
    local = tensor.to_local()
    sizes, offsets = shard_chunk(tensor)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                    properties=TensorProperties.create_from_tensor(local), size=tensor.size()),
    )


class _Planned:
    """Stands in for a DTensor while DCP builds the local plan: its write items, already made (DCP's
    ``__create_write_items__`` protocol); none where this rank is not in the DTensor's mesh."""

    def __init__(self, items: list) -> None:
        self._items = items

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        return self._items


class _Placed:
    """Stands in for a DTensor while DCP builds a local load plan: its global size and its shard's chunk, from
    ``shard_chunk`` (DCP's ``_create_chunk_list`` takes ``__create_chunk_list__``)."""

    def __init__(self, tensor: DTensor) -> None:
        self._size = tensor.size()
        sizes, offsets = shard_chunk(tensor)
        self._chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list:
        return [self._chunk]


def placed_for_load(state_dict: dict) -> dict:
    """Stand-ins (``_Placed``) for the DTensors of a flat state dict that DCP's default load planner would place
    with torch's ``compute_local_shape_and_global_offset``: those in a mesh this rank is part of, over a plain
    local tensor, with no partial placement."""
    out: dict = {}
    for fqn, obj in state_dict.items():
        if type(obj) is DTensor and obj.device_mesh.get_coordinate() is not None and _plain_shard(obj):
            out[fqn] = _Placed(obj)
    return out


def _plain_shard(tensor: DTensor) -> bool:
    """Whether DCP plans ``tensor`` as one chunk over a plain local tensor (no partial placement, no other
    local tensor subclass): the DTensors placed here; DCP plans (or refuses) the others itself."""
    return type(tensor.to_local()) is torch.Tensor and not any(p.is_partial() for p in tensor.placements)


class LinearMergePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose global plan merges the planner data linearly (``merge_planner_data``) and
    whose local plan places DTensor shards once per layout (``shard_chunk``)."""

    def create_local_plan(self) -> Any:
        state_dict = self.state_dict
        planned = {}
        for fqn, obj in state_dict.items():
            if type(obj) is not DTensor:
                continue
            if obj.device_mesh.get_coordinate() is None:
                planned[fqn] = _Planned([])
            elif (item := dtensor_write_item(fqn, obj)) is not None:
                planned[fqn] = _Planned([item])
        if not planned:
            return super().create_local_plan()
        self.state_dict = {**state_dict, **planned}  # DCP's own loop and plan caching, over the items made here
        try:
            return super().create_local_plan()
        finally:
            self.state_dict = state_dict

    def _create_global_plan(self, all_plans: list) -> tuple[list, Any]:
        flatten = self.flatten_state_dict
        self.flatten_state_dict = False  # the base class then skips its quadratic merge
        try:
            global_plan, metadata = super()._create_global_plan(all_plans)
        finally:
            self.flatten_state_dict = flatten
        if flatten:
            merged = merge_planner_data([p.planner_data for p in global_plan])
            metadata = dataclasses.replace(metadata, planner_data=merged)
        return global_plan, metadata
