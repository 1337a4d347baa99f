"""The fingerprint pass takes the CRC32C of each staged tensor while summing it, and the writer uses it:
exactly one side takes each CRC, whatever the order they meet in, and a save's recorded checksums are
those of the bytes on disk."""

from __future__ import annotations

import threading
import time

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_core import CheckpointManager, TrainState
from ckpt_core import dcp_io
from ckpt_core import fingerprint as fp
from ckpt_core.manifest import parse_manifest
from ckpt_core.sidecar import SIDECAR_SUFFIX, parse_sidecar
from ckpt_core.staged_crc import StagedCrcs


def _bytes_crc(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_sums_come_with_the_crc_of_the_tensors_bytes(dtype):
    t = torch.randn(3 * fp._CHUNK + 17, generator=torch.Generator().manual_seed(0)).to(dtype)
    entry, crc = fp.entry_and_crc(t)
    assert entry == fp.tensor_entry(t)
    assert crc == _bytes_crc(t)
    assert fp.entry_and_crc(t, crc=False) == (fp.tensor_entry(t), None)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(64, 64).t(),  # not contiguous: the sums read other bytes than the tensor's order
    lambda: torch.randn(64)._neg_view(),  # a pending negation: the summed bytes are a copy
    lambda: torch.arange(4096),  # not a dtype summed in numpy
    lambda: torch.empty(0),
])
def test_no_crc_where_the_summed_bytes_are_not_the_tensors_own(make):
    t = make()
    assert not fp.crc_fusable(t)
    assert fp.entry_and_crc(t) == (fp.tensor_entry(t), None)


def test_a_tensor_the_pass_has_not_started_is_the_writers_and_the_pass_skips_its_crc():
    crcs = StagedCrcs([(1, 10), (2, 10)])
    assert crcs.take((1, 10)) is None
    assert crcs.begin((1, 10)) is False
    assert crcs.begin((2, 10)) is True
    crcs.done((2, 10), 1234)
    assert crcs.take((2, 10)) == 1234 and crcs.taken == 1
    assert crcs.take((3, 10)) is None  # never planned


def test_the_writer_waits_while_the_pass_sums_that_tensor():
    crcs = StagedCrcs([(1, 10)])
    assert crcs.begin((1, 10))
    got = []
    writer = threading.Thread(target=lambda: got.append(crcs.take((1, 10))))
    writer.start()
    time.sleep(0.05)
    assert writer.is_alive() and got == []
    crcs.done((1, 10), 99)
    writer.join(5)
    assert got == [99]


def test_a_pass_that_ends_early_hands_everything_back_to_the_writer():
    crcs = StagedCrcs([(1, 10), (2, 10)])
    assert crcs.begin((1, 10))
    got = []
    writer = threading.Thread(target=lambda: got.append(crcs.take((1, 10))))
    writer.start()
    crcs.close()  # the pass failed while summing (1, 10)
    writer.join(5)
    assert got == [None] and crcs.take((2, 10)) is None and crcs.begin((2, 10)) is False
    crcs.done((1, 10), None)  # a pass that could not take a CRC leaves it to the writer too
    assert crcs.take((1, 10)) is None


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_exactly_one_side_takes_each_crc_whatever_the_interleaving(n, data):
    """The pass goes through the keys in order (begin, then done), the writer in an order of its own; at
    each step either may move, the writer never past a key the pass is summing (it waits there)."""
    keys = [(k, 8) for k in range(n)]
    crc_of = {key: 1000 + key[0] for key in keys}
    crcs = StagedCrcs(keys)
    writer_order = data.draw(st.permutations(keys))
    by_pass, by_writer, running, pass_at, writer_at = set(), {}, None, 0, 0
    while writer_at < n:
        blocked = writer_order[writer_at] == running
        pass_can = pass_at < n or running is not None
        if pass_can and (blocked or data.draw(st.booleans())):
            if running is not None:
                crcs.done(running, crc_of[running])
                by_pass.add(running)
                running = None
            else:
                if crcs.begin(keys[pass_at]):
                    running = keys[pass_at]
                pass_at += 1
            continue
        key = writer_order[writer_at]
        by_writer[key] = crcs.take(key)
        writer_at += 1
    for key in keys:
        from_pass = by_writer[key] is not None
        assert from_pass == (key in by_pass)
        assert by_writer[key] in (None, crc_of[key])
    assert crcs.taken == sum(v is not None for v in by_writer.values())


def _recording(monkeypatch, order: str) -> list:
    """Record every ``StagedCrcs`` of the saves; ``order``: "pass" makes the writer wait until the pass has
    ended (the pass takes every CRC it can), "writer" makes the pass take none (the writer takes all),
    "race" leaves them to meet as they do."""
    seen: list = []

    class Recording(StagedCrcs):
        def __init__(self, keys):
            super().__init__(keys)
            self.ended = threading.Event()
            seen.append(self)

        def begin(self, key):
            return order != "writer" and super().begin(key)

        def close(self):
            super().close()
            self.ended.set()

        def take(self, key):
            if order == "pass":
                self.ended.wait(30)
            return super().take(key)

    monkeypatch.setattr(dcp_io, "StagedCrcs", Recording)
    return seen


def _state() -> tuple[dict, int]:
    """Tensors of 1 MiB and more, fusable (float32, bfloat16) or not (int64, a transposed view), and small
    ones; returns the state and how many of its tensors the pass can take the CRC of."""
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Module()
    model.register_buffer("w", torch.randn(512, 1024, generator=g))
    model.register_buffer("bf", torch.randn(1024, 1024, generator=g).to(torch.bfloat16))
    model.register_buffer("ids", torch.randint(0, 9, (300_000,), generator=g))
    model.register_buffer("tr", torch.randn(1024, 512, generator=g).t())
    model.register_buffer("small", torch.randn(100, generator=g))
    return {"model": model}, 2


@pytest.mark.parametrize("async_mode,direct_io,order", [
    ("off", True, "pass"), ("thread", True, "pass"), ("thread", False, "pass"),
    ("thread", True, "writer"), ("off", False, "writer"), ("thread", True, "race"),
    ("process", True, "race"),  # the writer process's own pass and writer: not recorded here
    ("bytes", True, "race"), ("bytes", False, "race")])  # the byte writer process sums and checksums
def test_a_save_records_the_crcs_of_the_bytes_on_disk_whoever_takes_them(tmp_path, monkeypatch, async_mode,
                                                                          direct_io, order):
    seen = _recording(monkeypatch, order)
    state, fusable = _state()
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), async_mode=async_mode, direct_io=direct_io, lease=False,
                           handle_preemption=False) as m:
        m.save(1, TrainState(**state))
        m.wait()
    taken = sum(c.taken for c in seen)
    assert taken == {"pass": fusable, "writer": 0}.get(order, taken) and 0 <= taken <= fusable
    step = next(root.glob("step_*"))
    manifest = parse_manifest((step / "manifest.json").read_bytes())
    for name, entry in manifest.files.items():
        data = (step / name).read_bytes()
        assert (len(data), crc32c.crc32c(data)) == (entry.size, entry.crc32c), name
    checked = 0
    for side in step.glob(f"*{SIDECAR_SUFFIX}"):
        for (name, offset, length), crc in parse_sidecar(side.read_bytes()).items.items():
            assert crc32c.crc32c((step / name).read_bytes()[offset:offset + length]) == crc
            checked += 1
    assert checked >= 5
    again = {"model": torch.nn.Module()}
    for k, v in state["model"].named_buffers():
        again["model"].register_buffer(k, torch.zeros_like(v))
    with CheckpointManager(str(root), lease=False, handle_preemption=False) as m:
        assert m.resume(TrainState(**again)).step == 1
    for k, v in state["model"].named_buffers():
        assert torch.equal(dict(again["model"].named_buffers())[k], v), k
