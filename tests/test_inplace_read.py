"""Tensor items read straight into their load targets (``ckpt_core.inplace_read``), and DCP's path for the rest."""

from __future__ import annotations

import io
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

from ckpt_core import dcp_io, inplace_read
from ckpt_core.dcp_io import SafeLoadPlanner, SafeLocalReader


def _save(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))


def _load(path, template, monkeypatch):
    """Load ``template`` through the safe reader; returns the fqns DCP's own path had to read."""
    left: list[str] = []

    def spy(reader, plan, planner):
        rest = inplace_read.read_in_place(reader, plan, planner)
        left.extend(r.dest_index.fqn for r in rest.items if r.type == LoadItemType.TENSOR)
        return rest

    monkeypatch.setattr(dcp_io, "read_in_place", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, storage_reader=SafeLocalReader(str(path)), planner=SafeLoadPlanner())
    return left


def test_tensors_of_every_shape_and_dtype_are_read_in_place(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    saved = {
        "m": torch.randn(64, 32, generator=g),
        "half": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "view": torch.arange(100, dtype=torch.float32)[10:50],  # torch.save keeps the whole storage
        "ints": torch.randint(-9, 9, (5, 2, 3), generator=g),
        "flags": torch.tensor([True, False, True]),
        "blob": ["not", "a tensor"],
    }
    _save(tmp_path, saved)
    template = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else [] for k, v in saved.items()}
    template["view"] = torch.empty(40)
    assert _load(tmp_path, template, monkeypatch) == []
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert template[k].dtype == v.dtype and torch.equal(template[k], v), k
    assert template["blob"] == ["not", "a tensor"]


def test_what_cannot_be_read_in_place_goes_through_dcp(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    saved = {
        "transposed": torch.randn(8, 5, generator=g).t(),  # not contiguous on disk
        "cast": torch.randn(6, generator=g),  # fp32 on disk, loaded into bf16
        "plain": torch.randn(6, generator=g),
    }
    _save(tmp_path, saved)
    template = {"transposed": torch.empty(5, 8), "cast": torch.empty(6, dtype=torch.bfloat16),
                "plain": torch.empty(6)}
    assert sorted(_load(tmp_path, template, monkeypatch)) == ["cast", "transposed"]
    assert torch.equal(template["transposed"], saved["transposed"])
    assert torch.equal(template["cast"], saved["cast"].to(torch.bfloat16))
    assert torch.equal(template["plain"], saved["plain"])


@pytest.mark.parametrize("shape,lengths,one", [
    ((6, 4), (6, 4), True),
    ((6, 4), (3, 4), True),  # rows
    ((6, 4), (1, 2), True),  # part of one row
    ((6, 4), (3, 2), False),  # a block of columns
    ((2, 4, 8), (1, 2, 8), True),
    ((2, 4, 8), (2, 2, 8), False),
    ((6, 4), (0, 4), True),
])
def test_one_contiguous_byte_range(shape, lengths, one):
    assert inplace_read._one_range(shape, lengths) is one


def test_byte_range_of_a_region_of_a_saved_tensor():
    t = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)[1]  # storage offset 24
    buf = io.BytesIO()
    torch.save(t, buf)
    req = SimpleNamespace(storage_offsets=(2, 0), lengths=(3, 4))
    start = inplace_read._byte_range(buf, req, torch.empty(3, 4))
    buf.seek(start)
    assert torch.equal(torch.frombuffer(bytearray(buf.read(3 * 4 * 4)), dtype=torch.float32).reshape(3, 4), t[2:5])
    assert inplace_read._byte_range(buf, SimpleNamespace(storage_offsets=(0, 1), lengths=(6, 2)),
                                    torch.empty(6, 2)) is None
