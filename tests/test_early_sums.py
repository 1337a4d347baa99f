"""Fingerprint entries summed while a load reads (``ckpt_core.early_sums``): when a tensor counts as complete,
how its regions' pieces add up, which tensors are left to the pass after the load."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, strategies as st

from ckpt_core import fingerprint as fp, inplace_read
from ckpt_core.dcp_io import SafeLoadPlanner, SafeLocalReader, make_reader
from ckpt_core.early_sums import EarlySums, _overlapping


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fill(sums: EarlySums, name: str, region: torch.Tensor, piece: int) -> None:
    """Report ``region`` of ``name`` as the reading threads do: piece by piece, then filled."""
    for upto in range(piece, _nbytes(region) + piece, piece):
        sums.read(name, region, min(upto, _nbytes(region)))
    sums.filled([(name, region)])


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3000, generator=g), "b": torch.randn(40, 50, generator=g).to(torch.bfloat16),
            "c": torch.randn(700, generator=g, dtype=torch.float64), "d": torch.randint(-9, 9, (99,), generator=g)}


def test_a_tensor_is_summed_from_the_pieces_of_its_regions_once_every_request_is_in():
    tensors = _tensors()
    sums = EarlySums(tensors)
    try:
        sums.expect(["a", "a", "b", "c", "d", "d", "other"])
        _fill(sums, "a", tensors["a"][:1000], 1024)  # a's first request (of two)
        _fill(sums, "a", tensors["a"][1000:], 4096)
        _fill(sums, "b", tensors["b"], 1001)  # pieces that end inside an element: summed once it is whole
        sums.filled([("c", tensors["c"])])  # an item read whole: no pieces
        _fill(sums, "d", tensors["d"][:50], 64)  # d's second request never comes
        sums.filled([("other", torch.ones(3))])
        got = sums.entries()
    finally:
        sums.close()
    assert set(got) == {"a", "b", "c"}
    assert fp.compare({k: fp.tensor_entry(tensors[k]) for k in got}, got) == []
    assert got["c"] == fp.tensor_entry(tensors["c"])


def test_regions_that_do_not_tile_their_tensor_give_the_whole_tensors_sum():
    a = _tensors()["a"]
    sums = EarlySums({"a": a})
    try:
        sums.expect(["a", "a"])
        _fill(sums, "a", a[:2000], 4096)
        _fill(sums, "a", a[1000:], 4096)  # overlaps the first: its sums would count bytes twice
        assert sums.entries() == {"a": fp.tensor_entry(a)}
    finally:
        sums.close()


def test_a_region_outside_its_tensor_drops_every_early_entry():
    tensors = _tensors()
    sums = EarlySums(tensors)
    try:
        sums.expect(["a", "c"])
        sums.filled([("c", tensors["c"])])
        sums.filled([("a", torch.randn(3000))])  # a copy, not the tensor's memory
        assert sums.entries() == {}
    finally:
        sums.close()


def test_tensors_that_share_bytes_or_are_not_contiguous_or_not_planned_are_left_for_after_the_load():
    flat = torch.arange(40, dtype=torch.float32)
    tied = torch.ones(6)
    tensors = {"tied1": tied, "tied2": tied, "left": flat[0:20], "right": flat[20:40], "across": flat[15:25],
               "next": flat[25:30].clone(), "t": torch.ones(3, 4).t(), "unplanned": torch.ones(3)}
    sums = EarlySums(tensors)
    try:
        sums.expect([k for k in tensors if k != "unplanned"])
        sums.filled(list(tensors.items()))
        assert set(sums.entries()) == {"next"}
    finally:
        sums.close()


def test_views_side_by_side_in_one_buffer_are_summed_early():
    flat = torch.arange(40, dtype=torch.float32)
    sums = EarlySums({"left": flat[:20], "right": flat[20:]})
    try:
        sums.expect(["left", "right"])
        sums.filled([("right", flat[20:]), ("left", flat[:20])])
        assert sums.entries() == {"left": fp.tensor_entry(flat[:20]), "right": fp.tensor_entry(flat[20:])}
    finally:
        sums.close()


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=12))
def test_overlapping_names_exactly_the_tensors_whose_bytes_meet_another(spans):
    buf = torch.zeros(100, dtype=torch.uint8)
    tensors = {f"t{i}": buf[s : s + n] for i, (s, n) in enumerate(spans)}
    expected = {a for i, (a, x) in enumerate(tensors.items()) for j, (b, y) in enumerate(tensors.items())
                if i != j and x.data_ptr() < y.data_ptr() + y.numel() and y.data_ptr() < x.data_ptr() + x.numel()}
    assert _overlapping(tensors) == expected


def _save(path, state) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))


def _load(template, reader) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner())


def test_a_request_left_to_dcps_own_path_never_counts_its_tensor_as_complete(tmp_path):
    g = torch.Generator().manual_seed(1)
    saved = {"transposed": torch.randn(8, 5, generator=g).t(), "cast": torch.randn(6, generator=g),
             "plain": torch.randn(6, generator=g)}
    _save(tmp_path, saved)
    template = {"transposed": torch.empty(5, 8), "cast": torch.empty(6, dtype=torch.bfloat16),
                "plain": torch.empty(6)}
    reader = SafeLocalReader(str(tmp_path))
    reader.early_sums = sums = EarlySums(template)  # every target contiguous: only the read decides
    try:
        _load(template, reader)
        assert sums.entries() == {"plain": fp.tensor_entry(saved["plain"])}
    finally:
        sums.close()
    assert torch.equal(template["cast"], saved["cast"].to(torch.bfloat16))


def test_a_large_item_is_summed_piece_by_piece_as_the_direct_reads_land(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(2)
    saved = {"big": torch.randn(3 << 18, generator=g), "small": torch.randn(10, generator=g)}  # 3 MiB, 40 bytes
    _save(tmp_path, saved)
    template = {k: torch.empty_like(v) for k, v in saved.items()}
    monkeypatch.setattr(inplace_read, "PIECE", 256 << 10)
    heard: list = []
    real = EarlySums.read
    monkeypatch.setattr(EarlySums, "read", lambda self, name, region, upto: (heard.append((name, upto)),
                                                                           real(self, name, region, upto)))
    reader = make_reader(str(tmp_path))
    reader.early_sums = sums = EarlySums(template)
    try:
        _load(template, reader)
        got = sums.entries()
    finally:
        sums.close()
    assert heard == [("big", upto) for upto in range(256 << 10, (3 << 20) + 1, 256 << 10)]
    assert torch.equal(template["big"], saved["big"]) and torch.equal(template["small"], saved["small"])
    assert set(got) == {"big", "small"}
    assert fp.compare({k: fp.tensor_entry(v) for k, v in saved.items()}, got) == []
