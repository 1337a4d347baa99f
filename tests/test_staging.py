"""The thread mode's staged copies (ckpt_core/staging.py): large storages start at a page boundary, hold the
state's exact bytes, are reused from save to save, and a thread-mode save then writes their whole blocks
straight from them (no bounce copy); small storages and shared memory stay as DCP makes them."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import StagingOptions

import ckpt_core.direct_io as dio
from ckpt_core import CheckpointManager, TrainState, dcp_io
from ckpt_core.staging import AlignedStager
from test_direct_read import direct_io_works

MIB = 1 << 20


def _options(shared: bool) -> StagingOptions:
    return StagingOptions(use_pinned_memory=False, use_shared_memory=shared, use_async_staging=False,
                          use_non_blocking_copy=False)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3 * MIB // 4 + 5, generator=g)  # 3 MiB + 20 bytes, an odd tail
    return {"big": big, "view": big[7:1000], "small": torch.arange(10), "bf16": torch.randn(MIB, generator=g).bfloat16()}


def test_large_staged_storages_are_page_aligned_exact_and_reused():
    stager = AlignedStager(_options(shared=False))
    state = _state(0)
    staged = stager.stage(state)
    for name in ("big", "bf16"):
        assert staged[name].untyped_storage().data_ptr() % dio.BLOCK == 0, name
    for name, t in state.items():
        assert torch.equal(staged[name], t) and staged[name].stride() == t.stride(), name
    assert staged["view"].untyped_storage().data_ptr() == staged["big"].untyped_storage().data_ptr()
    first = staged["big"].untyped_storage().data_ptr()
    state["big"].mul_(-2)
    again = stager.stage(state)
    assert again["big"].untyped_storage().data_ptr() == first
    assert torch.equal(again["big"], state["big"]) and torch.equal(again["view"], state["big"][7:1000])
    stager.close()


def test_shared_memory_staging_stays_dcps():
    stager = AlignedStager(_options(shared=True))
    staged = stager.stage(_state(1))
    assert staged["big"].is_shared()
    stager.close()


def test_an_unknown_dcp_stager_is_left_as_dcp_makes_it(monkeypatch):
    """If DCP's private stager changes shape, staging stays DCP's: exact copies, nothing replaced."""
    from torch.distributed.checkpoint import staging as dcp_staging

    real_init = dcp_staging.DefaultStager.__init__

    def init_with_another_stager(self, options):
        real_init(self, options)
        self._state_dict_stager = _Other(self._state_dict_stager)

    class _Other:  # a stand-in for a renamed or reshaped private stager
        def __init__(self, inner):
            self.inner = inner

        def stage(self, *args, **kwargs):
            return self.inner.stage(*args, **kwargs)

        def close(self):
            self.inner.close()

    monkeypatch.setattr(dcp_staging.DefaultStager, "__init__", init_with_another_stager)
    stager = AlignedStager(_options(shared=False))
    assert type(stager._state_dict_stager) is _Other
    state = _state(2)
    staged = stager.stage(state)
    for name, t in state.items():
        assert torch.equal(staged[name], t), name
    stager.close()


def test_a_thread_mode_save_writes_large_tensors_straight_and_restores_exactly(tmp_path, monkeypatch):
    if not direct_io_works(tmp_path):
        pytest.skip("the file system of the temporary directory refuses O_DIRECT")
    monkeypatch.setattr(dcp_io, "ALIGN_OVERHEAD", 1.0)  # aligned files whatever the small items add
    straight: list[int] = []
    real = dio.DirectFile._write_straight
    monkeypatch.setattr(dio.DirectFile, "_write_straight",
                        lambda self, src, crc: (straight.append(len(src)), real(self, src, crc))[1])
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight (written straight) and a 4 KiB bias (not)
    with CheckpointManager(str(tmp_path), async_mode="thread", handle_preemption=False) as m:
        m.save(5, TrainState(model=model))
        m.wait()
    assert sum(straight) == model.weight.numel() * 4, straight
    fresh = torch.nn.Linear(1024, 1024)
    with CheckpointManager(str(tmp_path), async_mode="off", handle_preemption=False) as m:
        assert m.restore(TrainState(model=fresh)).step == 5
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
