"""Block-aligned data files: a direct save starts every item and every large tensor's bytes at a block boundary,
and a restore reads those bytes with ``O_DIRECT`` straight into block-aligned load buffers, without a copy.

The padding between items is zeros in the file's checksum and in no item. Checkpoints written packed (by an
older version, or with buffered writes) restore exactly through the bounce buffer. These tests read the
offsets from the files themselves, damage bytes in the padding and in the straight-read regions, and compare
restored tensors bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from ckpt_core import TrainState, dcp_io, inplace_read
from ckpt_core.dcp_io import DATA_SUFFIX, read_metadata
from ckpt_core.direct_io import BLOCK
from helpers_ckpt import flip_byte, run_cli, save_distinct, step_path
from test_direct_read import Odd, _restore, direct_io_works

SCALE = 16
"""``Odd(16)``: items of 59 to 117 KiB, above twice the envelope (read in parts, not whole)."""
LARGE = ("a", "b", "c", "d")
"""The tensors of ``Odd(SCALE)`` of at least 4 KiB (``e`` has 12 bytes)."""


@pytest.fixture
def small_aligned(tmp_path, monkeypatch):
    """Aligned files from tensors of 4 KiB, direct reads of regions from 4 KiB in 8 KiB reads: the layout and
    both read paths on tensors of a few KiB."""
    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the test directory refuses O_DIRECT")
    monkeypatch.setattr(dcp_io, "ALIGN_MIN", 4096)
    monkeypatch.setattr(dcp_io, "ALIGN_OVERHEAD", 100.0)
    monkeypatch.setattr(inplace_read, "DIRECT_MIN", 4096)
    monkeypatch.setattr(inplace_read, "DIRECT_CHUNK", 8192)
    monkeypatch.setattr(inplace_read, "READ_CHUNK", 8192)
    monkeypatch.setattr(inplace_read, "ENVELOPE", 6 * 4096)  # the storage record's bytes start in the sixth block
    monkeypatch.setattr(inplace_read, "WHOLE_ITEM", 0)


def _items(ckpt: str) -> dict[str, tuple[str, int, int]]:
    """fqn -> (file, offset, length) of each DCP tensor item of checkpoint ``ckpt``."""
    md = read_metadata(ckpt)
    return {i.fqn: (os.path.basename(str(s.relative_path)), s.offset, s.length)
            for i, s in md.storage_data.items() if i.fqn.startswith("model.")}


def _data_offsets(ckpt: str, weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Where each large tensor's bytes lie in its data file (found by content)."""
    found = {}
    for name, (file, _, _) in _items(ckpt).items():
        key = name.removeprefix("model.")
        if key in LARGE:
            data = Path(ckpt, file).read_bytes()
            found[key] = data.find(weights[key].contiguous().view(torch.uint8).numpy().tobytes())
    return found


def test_a_direct_save_starts_every_item_and_large_tensor_at_a_block_boundary(tmp_path, small_aligned):
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    weights = save_distinct(root, TrainState(model=model), model, (10,))[10]
    ckpt = step_path(root, 10)
    offsets = _data_offsets(ckpt, weights)
    assert sorted(offsets) == sorted(LARGE) and all(o > 0 and o % BLOCK == 0 for o in offsets.values()), offsets
    assert all(offset % BLOCK == 0 for _, offset, _ in _items(ckpt).values())
    restored, step, said = _restore(root, direct=True, scale=SCALE)
    assert (step, said) == (10, "")
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights.items())


def test_a_save_below_the_alignment_threshold_stays_packed(tmp_path, small_aligned, monkeypatch):
    """No tensor of ``ALIGN_MIN`` bytes: the items lie back to back, with no padding between them."""
    monkeypatch.setattr(dcp_io, "ALIGN_MIN", 1 << 30)
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    save_distinct(root, TrainState(model=model), model, (10,))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for file, offset, length in _items(step_path(root, 10)).values():
        by_file.setdefault(file, []).append((offset, length))
    ends = [(spans[i][0] + spans[i][1], spans[i + 1][0]) for spans in map(sorted, by_file.values())
            for i in range(len(spans) - 1)]
    assert ends and all(end == start for end, start in ends), ends
    assert any(offset % BLOCK for spans in by_file.values() for offset, _ in spans)


def _padding_byte(ckpt: str) -> tuple[str, int]:
    """(file, offset) of a byte of padding: between two items of a data file, in neither."""
    spans: dict[str, list[tuple[int, int]]] = {}
    md = read_metadata(ckpt)
    for s in md.storage_data.values():
        spans.setdefault(os.path.basename(str(s.relative_path)), []).append((s.offset, s.length))
    for file, runs in sorted(spans.items()):
        runs.sort()
        for (offset, length), (following, _) in zip(runs, runs[1:]):
            if following > offset + length:
                return file, offset + length
    raise AssertionError("no padding between the items of any data file")


def test_the_padding_is_in_the_files_checksum_and_in_no_item(tmp_path, small_aligned, capsys):
    """A damaged padding byte changes nothing a restore applies (it restores that checkpoint exactly) and fails
    ``ckpt verify --checksum``, which checks every byte of every file."""
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    weights = save_distinct(root, TrainState(model=model), model, (10,))[10]
    ckpt = step_path(root, 10)
    assert run_cli(capsys, "verify", "--checksum", ckpt)[0] == 0
    file, offset = _padding_byte(ckpt)
    assert Path(ckpt, file).read_bytes()[offset] == 0
    flip_byte(ckpt, file, offset)
    code, out, _ = run_cli(capsys, "verify", "--checksum", ckpt)
    assert code == 1 and file in out, out
    restored, step, said = _restore(root, direct=True, scale=SCALE)
    assert (step, said) == (10, "")
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights.items())


def _counting(monkeypatch) -> dict[str, list[int]]:
    """The lengths of the reads of ``_read_straight`` (no copy) and of ``_read_bounced`` (through the bounce
    buffer)."""
    counts: dict[str, list[int]] = {"straight": [], "bounced": []}
    for kind in counts:
        real = getattr(inplace_read, f"_read_{kind}")

        def counted(source, offset, dest, digest, stop, real=real, kind=kind):
            counts[kind].append(len(dest))
            return real(source, offset, dest, digest, stop)

        monkeypatch.setattr(inplace_read, f"_read_{kind}", counted)
    return counts


def _read_counted(tmp_path: Path, monkeypatch, **settings) -> tuple[dict, list[int]]:
    """Save ``Odd`` and restore it exactly (``settings`` for the restoring manager), counting the direct reads:
    ``(the reads' lengths by kind, the large regions' sizes, sorted)``."""
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    weights = save_distinct(root, TrainState(model=model), model, (10,))[10]
    counts = _counting(monkeypatch)
    restored, step, said = _restore(root, direct=True, scale=SCALE, **settings)
    assert (step, said) == (10, "")
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights.items())
    return counts, sorted(weights[k].numel() * weights[k].element_size() for k in LARGE)


def test_an_aligned_checkpoint_is_read_straight_into_aligned_fresh_buffers(tmp_path, small_aligned, monkeypatch):
    """Loading into fresh buffers (``restore_in_place=False``), all whole blocks of each large region go
    straight into the load buffer; only each region's last partial block passes through the bounce buffer."""
    counts, regions = _read_counted(tmp_path, monkeypatch, restore_in_place=False)
    assert sorted(counts["straight"]) == sorted(r // BLOCK * BLOCK for r in regions), (counts, regions)
    assert sorted(counts["bounced"]) == sorted(r % BLOCK for r in regions), (counts, regions)


def test_an_aligned_checkpoint_is_read_directly_into_the_live_tensors(tmp_path, small_aligned, monkeypatch):
    """Loading in place (the default), every byte of each large region is read directly into the live tensor
    (through the bounce buffer where the tensor does not lie on a block boundary), exactly once."""
    counts, regions = _read_counted(tmp_path, monkeypatch)
    assert sum(counts["straight"]) + sum(counts["bounced"]) == sum(regions), (counts, regions)


def test_a_packed_checkpoint_is_read_through_the_bounce_buffer_exactly(tmp_path, small_aligned, monkeypatch):
    """A checkpoint of a version that packed its items: every region is read directly, none straight."""
    monkeypatch.setattr(dcp_io, "ALIGN_MIN", 1 << 30)
    monkeypatch.setattr(inplace_read, "ENVELOPE", 4096)  # packed: storage bytes start in the first block
    counts, regions = _read_counted(tmp_path, monkeypatch, restore_in_place=False)
    assert counts["straight"] == []
    assert [n for n in sorted(counts["bounced"]) if n in regions] == regions, (counts, regions)


@pytest.mark.parametrize("where", [0, 4096, 0.5, -1])
def test_a_damaged_byte_in_a_straight_read_falls_back_naming_the_file(tmp_path, small_aligned, where):
    """A byte flipped in the first block, the second, the middle or the last byte of ``c``'s storage."""
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    ckpt = step_path(root, 20)
    start = _data_offsets(ckpt, weights[20])["c"]
    size = weights[20]["c"].numel() * 8
    at = {0: 0, 4096: 4096, 0.5: size // 2, -1: size - 1}[where]
    name = _items(ckpt)["model.c"][0]
    flip_byte(ckpt, name, start + at)
    restored, step, said = _restore(root, direct=True, scale=SCALE)
    assert step == 10 and "step 20" in said and name in said, said
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())


def test_a_file_cut_inside_a_straight_read_falls_back(tmp_path, small_aligned):
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    ckpt = step_path(root, 20)
    start = _data_offsets(ckpt, weights[20])["c"]
    name = _items(ckpt)["model.c"][0]
    os.truncate(os.path.join(ckpt, name), start + 2 * BLOCK + 100)
    restored, step, said = _restore(root, direct=True, scale=SCALE)
    assert step == 10 and "step 20" in said, said
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())


_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 70), min_size=0, max_size=3), dtype=st.sampled_from(_DTYPES),
       transpose=st.booleans())
@example(shape=[1, 32, 32], dtype=torch.float32, transpose=True)  # a size-1 dimension keeps its stride (1024)
def test_aligned_empty_like_keeps_shape_dtype_and_strides_and_aligns_large_tensors(shape, dtype, transpose):
    """Shape, dtype, strides and device as ``empty_like``; a block-aligned start for contiguous tensors of at
    least ``DIRECT_MIN`` bytes (here 4 KiB)."""
    t = torch.zeros(shape, dtype=dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)
    old = inplace_read.DIRECT_MIN
    inplace_read.DIRECT_MIN = 4096
    try:
        for _ in range(3):  # fresh allocations at different addresses
            out = inplace_read.aligned_empty_like(t)
            reference = torch.empty_like(t)
            assert (out.shape, out.dtype, out.stride(), out.device) == \
                   (reference.shape, reference.dtype, reference.stride(), reference.device)
            if t.is_contiguous() and t.numel() * t.element_size() >= 4096:
                assert out.data_ptr() % BLOCK == 0
                out.view(-1).view(torch.uint8).fill_(7)  # every byte is writable memory of its own
                assert int(out.view(-1).view(torch.uint8).sum()) == 7 * t.numel() * t.element_size()
    finally:
        inplace_read.DIRECT_MIN = old


@pytest.mark.parametrize("sizes, expected", [
    ([], False),
    ([0, 0], False),                                   # byte items only
    ([(1 << 20) - 1], False),                          # no tensor of ALIGN_MIN bytes
    ([1 << 20], False),                                # 32 KiB of padding on 1 MiB: over 1 %
    ([4 << 20], True),                                 # 32 KiB on 4 MiB: 0.8 %
    ([4 << 20, 0, 0, 0], True),                        # byte items get no padding
    ([4 << 20] + [100] * 3, False),                    # four items, 128 KiB on 4 MiB
    ([256 << 20] + [4096] * 50, True),                 # a large tensor and small norms: 1.6 MiB on 256 MiB
    ([256 << 20] + [4096] * 100, False),               # 3.2 MiB on 256 MiB
])
def test_a_rank_aligns_its_files_only_when_the_padding_stays_under_one_percent(sizes, expected):
    assert dcp_io.aligns(sizes) is expected


@pytest.mark.parametrize("in_place", [True, False])
def test_a_value_changed_on_storage_is_caught_through_every_read_path(tmp_path, small_aligned, in_place):
    """Through the straight reads (fresh aligned buffers) or the bounce buffer (the live tensors), without
    checksums: the fingerprint of what was loaded catches a changed float64, and the restore falls back to the
    intact checkpoint exactly."""
    root = tmp_path / "run"
    model = Odd(scale=SCALE)
    weights = save_distinct(root, TrainState(model=model), model, (10, 20))
    ckpt = step_path(root, 20)
    name = _items(ckpt)["model.c"][0]
    flip_byte(ckpt, name, _data_offsets(ckpt, weights[20])["c"] + 8 * 1000 + 7)  # sign and exponent of one float64
    restored, step, said = _restore(root, direct=True, scale=SCALE, restore_in_place=in_place, verify="none")
    assert step == 10 and "model.c: sum" in said, said
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights[10].items())
