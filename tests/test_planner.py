"""The save and load planners' local step: DTensor shards placed once per layout, the plan identical to DCP's.

DCP places each DTensor shard with ``compute_local_shape_and_global_offset``
at every save (an int64 index as long as the shard along each sharded
dimension); ``LinearMergePlanner`` computes it once per layout and process and
must plan exactly what DCP plans, at 4 ranks on 1-D and 2-D meshes, uneven and
empty shards, two placements on one dimension, a mesh this rank is not in,
a ``Parameter``, and plain tensors beside them; a ``Partial`` DTensor is refused as DCP refuses it.
``SafeLoadPlanner`` plans the load of the same layouts as DCP's load planner does, without torch's placement,
and loads them exactly.
``shard_place`` places ``Shard``/``Replicate`` layouts from integers alone, as
torch places them (hypothesis, against torch's own function over explicit mesh
coordinates), and leaves other placements to torch.
"""

from __future__ import annotations

import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st


def _layouts():
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    half = DeviceMesh("cpu", torch.tensor([0, 1]))  # ranks 2 and 3 are not in it
    g = torch.Generator().manual_seed(0)

    def full(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "flat": distribute_tensor(full(10), mesh1, [Shard(0)]),  # 3, 3, 3, 1
        "cols": distribute_tensor(full(6, 5), mesh1, [Shard(1)]),  # 2, 2, 1, 0 columns: rank 3's shard is empty
        "grid": distribute_tensor(full(8, 6), mesh2, [Shard(0), Shard(1)]),
        "nested": distribute_tensor(full(8, 6), mesh2, [Shard(0), Shard(0)]),
        "mixed": distribute_tensor(full(7, 3), mesh2, [Replicate(), Shard(0)]),
        "param": torch.nn.Parameter(distribute_tensor(full(12), mesh1, [Shard(0)])),
        "subset": distribute_tensor(full(4, 4), half, [Shard(0)]),
        "plain": full(3),
        "step": 7,
    }


def _plan(planner_cls, state_dict, rank):
    planner = planner_cls()
    planner.set_up_planner(state_dict, None, rank == 0)
    return planner.create_local_plan()


def _partial_refusals(rank: int) -> list:
    """The errors DCP's planner and ours raise for a ``Partial`` DTensor (left to DCP, which refuses it)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from ckpt_core.planner import LinearMergePlanner

    partial = DTensor.from_local(torch.ones(4), init_device_mesh("cpu", (4,)), [Partial()], run_check=False)
    said = []
    for cls in (DefaultSavePlanner, LinearMergePlanner):
        try:
            _plan(cls, {"w": partial}, rank)
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    return said


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from torch.distributed.checkpoint import planner_helpers as dcp_helpers

    from ckpt_core import planner as ours

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls: list = []
    dcp_calls: list = []
    indexed: list = []  # torch's placement, which builds an index as long as the shard
    real, real_place = ours.compute_local_shape_and_global_offset, ours.shard_place
    ours.compute_local_shape_and_global_offset = lambda *a: (indexed.append(a), real(*a))[1]
    ours.shard_place = lambda *a: (calls.append(a), real_place(*a))[1]
    dcp_real = dcp_helpers.compute_local_shape_and_global_offset
    try:
        facts = {}
        expected = _plan(DefaultSavePlanner, _layouts(), rank)
        dcp_helpers.compute_local_shape_and_global_offset = lambda *a: (dcp_calls.append(a), dcp_real(*a))[1]
        got = _plan(ours.LinearMergePlanner, _layouts(), rank)
        facts["same_items"] = got.items == expected.items and len(got.items) > 0
        facts["same_planner_data"] = got.planner_data == expected.planner_data
        facts["items"] = len(got.items)
        facts["computed_first"] = len(calls)
        again = _plan(ours.LinearMergePlanner, _layouts(), rank)  # new objects of the same layouts: a new save
        facts["same_again"] = again.items == expected.items
        facts["computed_again"] = len(calls) - facts["computed_first"]
        facts["dcp_computed"] = len(dcp_calls)  # DCP's own placement, at every save, is not used
        facts["indexed"] = len(indexed)
        facts["partial"] = _partial_refusals(rank)
        facts.update(_load_facts(out, dcp_calls))
    finally:
        ours.compute_local_shape_and_global_offset, ours.shard_place = real, real_place
        dcp_helpers.compute_local_shape_and_global_offset = dcp_real
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


def _load_facts(out: str, dcp_calls: list) -> dict:
    """Save the layouts with DCP, plan their load with DCP's planner and with ``SafeLoadPlanner``, and load them
    into zeros of the same layouts with ours (``dcp_calls`` counts torch's placement inside DCP)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.tensor import DTensor

    from ckpt_core.dcp_io import SafeLoadPlanner

    path = os.path.join(out, "ckpt")
    saved = _layouts()
    dcp.save(saved, checkpoint_id=path)
    metadata = dcp.FileSystemReader(path).read_metadata()

    def load_plan(cls):
        planner = cls()
        planner.set_up_planner(_zeros(_layouts()), metadata, False)
        return planner.create_local_plan()

    expected = load_plan(DefaultLoadPlanner)
    before = len(dcp_calls)
    got = load_plan(SafeLoadPlanner)
    template = _zeros(_layouts())
    dcp.load(template, checkpoint_id=path, planner=SafeLoadPlanner())

    def local(v):
        return v.to_local() if isinstance(v, DTensor) else v

    loaded = all(torch.equal(local(template[k]), local(v)) for k, v in saved.items() if isinstance(v, torch.Tensor))
    return {"load_same_items": got.items == expected.items and len(got.items) > 0,
            "load_dcp_computed": len(dcp_calls) - before, "loaded_exactly": loaded and template["step"] == 7}


def _zeros(layouts: dict) -> dict:
    import torch

    out = {}
    for k, v in layouts.items():
        if isinstance(v, torch.Tensor):
            with torch.no_grad():
                z = v.detach().clone()
                z.zero_()
            out[k] = z
        else:
            out[k] = 0
    return out


def test_local_plan_is_dcps_with_each_layout_placed_once_at_4_ranks(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["same_items"] and facts["same_planner_data"] and facts["same_again"], (rank, facts)
        in_half = rank < 2  # "subset" has a shard on ranks 0 and 1 only
        assert facts["computed_first"] == 6 + in_half, (rank, facts)  # one per DTensor this rank holds a shard of
        assert facts["computed_again"] == 0 and facts["dcp_computed"] == 0, (rank, facts)
        assert facts["indexed"] == 0, (rank, facts)  # every layout here is Shard/Replicate: placed from integers
        assert facts["items"] == 6 + in_half + 2, (rank, facts)  # and the plain tensor and the int
        # the load plans its reads from the same places, without torch's index, and loads exactly
        assert facts["load_same_items"] and facts["load_dcp_computed"] == 0 and facts["loaded_exactly"], (rank, facts)
        dcp_says, ours_says = facts["partial"]
        assert dcp_says is not None and "partial placements" in dcp_says and ours_says == dcp_says, facts


_PLACEMENTS = st.lists(st.one_of(st.just(None), st.integers(0, 2)), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 13), min_size=1, max_size=3), dims=_PLACEMENTS,
       data=st.data())
def test_shard_place_is_torchs_placement(shape, dims, data):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from ckpt_core.planner import shard_place

    placements = tuple(Replicate() if d is None else Shard(d % len(shape)) for d in dims)
    mesh_shape = tuple(data.draw(st.integers(1, 5)) for _ in dims)
    coordinate = tuple(data.draw(st.integers(0, n - 1)) for n in mesh_shape)
    expected = _compute_local_shape_and_global_offset(tuple(shape), mesh_shape, list(coordinate), placements)
    assert shard_place(tuple(shape), mesh_shape, coordinate, placements) == expected


def test_shard_place_leaves_strided_shards_to_torch():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt_core.planner import shard_place

    assert shard_place((8,), (2, 2), (0, 1), (_StridedShard(0, split_factor=2), Shard(0))) is None
    assert shard_place((8,), (2,), (1,), (Shard(0),)) == ((4,), (4,))
