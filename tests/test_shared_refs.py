"""A process-mode save sends each shared-memory staging buffer to the checkpoint process once.

torch's reduction sends every shared storage as a file descriptor through
``multiprocessing.resource_sharer`` (a connection and a handshake per
storage, per save). ``shared_refs`` sends the storages the process already
holds as tokens: the tests check which storages travel, that the state the
process rebuilds is exactly the staged one, that the process lets go of
storages the stager dropped, and that a real writer process writes the
latest values of reused buffers after failures and restarts.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from multiprocessing.reduction import ForkingPickler

from ckpt_core import CheckpointManager, TrainState, background, shared_refs
from ckpt_core.errors import SaveError


@pytest.fixture(autouse=True)
def _fresh_held():
    shared_refs._HELD.clear()
    yield
    shared_refs._HELD.clear()


class _FdSpy:
    """Counts the storages torch's reduction sends as descriptors (and sends them as before)."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.sizes: list[int] = []
        reducers = ForkingPickler._extra_reducers
        real = reducers[torch.UntypedStorage]

        def counted(storage):
            self.count += 1
            self.sizes.append(storage.nbytes())
            return real(storage)

        monkeypatch.setitem(reducers, torch.UntypedStorage, counted)


def _shared(*sizes: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(sizes))
    return [torch.randn(n, generator=g).share_memory_() for n in sizes]


def _send(sent: shared_refs.SentStorages, staged):
    """What the checkpoint process gets: the wrapped state through torch's pickler (here, in one process)."""
    return pickle.loads(ForkingPickler.dumps(sent.wrap(staged)))


def test_storages_travel_once_and_later_saves_send_tokens(monkeypatch):
    spy = _FdSpy(monkeypatch)
    a, b = _shared(1000, 300)
    sent = shared_refs.SentStorages()
    first = _send(sent, {"a": a, "b": b, "step": 7})
    assert spy.count == 2 and len(sent) == 2
    a.add_(1.0)  # the next save's values, in the same staging buffers
    second = _send(sent, {"a": a, "b": b, "step": 8})
    assert spy.count == 2, "a storage the process holds was sent again"
    assert second["step"] == 8
    assert torch.equal(second["a"], a) and torch.equal(second["b"], b)
    assert second["a"].untyped_storage().data_ptr() == first["a"].untyped_storage().data_ptr()


def test_views_and_tied_tensors_keep_sharing_one_storage(monkeypatch):
    spy = _FdSpy(monkeypatch)
    (base,) = _shared(64)
    staged = {"w": base, "tied": base, "half": base[32:], "rows": base.view(8, 8).t()}
    got = _send(shared_refs.SentStorages(), staged)
    assert spy.count == 1
    ptrs = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(ptrs) == 1
    for k, t in staged.items():
        assert torch.equal(got[k], t) and got[k].stride() == t.stride()
        assert got[k].storage_offset() == t.storage_offset()


def test_a_storage_the_stager_dropped_is_released_in_the_process_and_a_new_one_sent(monkeypatch):
    spy = _FdSpy(monkeypatch)
    a, b = _shared(100, 200)
    sent = shared_refs.SentStorages()
    _send(sent, {"a": a, "b": b})
    (c,) = _shared(400)  # the state grew a tensor (an optimizer's moments after its first step)
    got = _send(sent, {"a": a, "c": c})
    assert spy.count == 3
    assert len(shared_refs._HELD) == 2 and len(sent) == 2
    held_ptrs = {s.data_ptr() for s in shared_refs._HELD.values()}
    assert held_ptrs == {got["a"].untyped_storage().data_ptr(), got["c"].untyped_storage().data_ptr()}
    assert torch.equal(got["c"], c)


def test_after_clear_every_storage_travels_again(monkeypatch):
    spy = _FdSpy(monkeypatch)
    a, b = _shared(10, 20)
    sent = shared_refs.SentStorages()
    _send(sent, {"a": a, "b": b})
    sent.clear()
    shared_refs._HELD.clear()  # a new checkpoint process holds nothing
    got = _send(sent, {"a": a, "b": b})
    assert spy.count == 4 and torch.equal(got["b"], b)


def test_a_process_missing_a_storage_fails_with_a_clear_error():
    (a,) = _shared(10)
    sent = shared_refs.SentStorages()
    _send(sent, {"a": a})
    shared_refs._HELD.clear()  # the process lost it, the record did not
    with pytest.raises(RuntimeError, match="does not hold staged storage"):
        _send(sent, {"a": a})


def test_a_private_storage_travels_as_before_and_an_empty_shared_one_as_a_token(monkeypatch):
    spy = _FdSpy(monkeypatch)
    sent = shared_refs.SentStorages()
    got = _send(sent, {"private": torch.arange(5.0), "empty": torch.empty(0).share_memory_()})
    # the private storage through torch's own reduction, inside the payload; then the new shared one, once
    assert spy.sizes == [20, 0]
    assert [s.nbytes() for _, s in sent._by_addr.values()] == [0]
    assert torch.equal(got["private"], torch.arange(5.0)) and got["empty"].numel() == 0


def _params(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, copied."""
    got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        got.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return got


def _net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_process_saves_write_the_latest_values_of_reused_buffers(tmp_path, monkeypatch):
    """Real writer process: each save's files hold that save's values, through a failed save and a restart."""
    spy = _FdSpy(monkeypatch)
    torch.manual_seed(0)
    model, opt = _net()
    state = TrainState(model=model, optimizers=opt)
    mgr = CheckpointManager(str(tmp_path / "ck"), async_mode="process", handle_preemption=False, keep_last=10)
    expected: dict[int, dict[str, torch.Tensor]] = {}

    def train_and_save(step: int) -> None:
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()  # step 1 creates Adam's moments: new storages in the second save
        mgr.save(step, state)
        mgr.wait()
        expected[step] = _params(model, opt)

    mgr.save(0, state)
    mgr.wait()
    expected[0] = _params(model, opt)
    sent_first = spy.count
    train_and_save(1)
    after_moments = spy.count
    assert after_moments > sent_first  # the optimizer's state after its first step
    train_and_save(2)
    train_and_save(3)
    # only the rank's small state travels again: TrainState serializes it into a new byte tensor at every save
    assert spy.sizes[after_moments:] == spy.sizes[after_moments - 1:after_moments] * 2
    assert sent_first >= 10

    background.PROCESS.stop()  # the process died: the next save starts one and sends everything
    train_and_save(4)
    assert spy.count > after_moments
    restarted = spy.count

    monkeypatch.setattr(shared_refs.SentStorages, "_pickle", _fail_once(shared_refs.SentStorages._pickle))
    with pytest.raises(SaveError):
        mgr.save(5, state)
        mgr.wait()
    train_and_save(6)
    assert spy.count > restarted  # the failed save cleared the record
    mgr.close()

    for step in (0, 1, 2, 3, 4, 6):
        fresh, fresh_opt = _net()
        CheckpointManager(str(tmp_path / "ck"), async_mode="off", handle_preemption=False).restore(
            TrainState(model=fresh, optimizers=fresh_opt), step=step, set_aside_newer=False)
        got = _params(fresh, fresh_opt)
        assert got.keys() == expected[step].keys()
        assert all(torch.equal(got[k], expected[step][k]) for k in got), f"step {step} holds other values"


def _fail_once(real):
    calls = {"n": 0}

    def maybe_fail(self, staged):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("the pipe to the checkpoint process broke")
        return real(self, staged)

    return maybe_fail


def _shm_mappings(pid: int) -> int:
    """How many of torch's shared-memory segments process ``pid`` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/torch_" in line)


def test_a_closed_manager_leaves_no_staging_buffer_mapped_in_the_writer(tmp_path):
    torch.manual_seed(0)
    model, opt = _net()
    mgr = CheckpointManager(str(tmp_path / "a"), async_mode="process", handle_preemption=False)
    mgr.save(1, TrainState(model=model, optimizers=opt))
    mgr.wait()
    writer = background.PROCESS._proc._save_process.pid
    assert _shm_mappings(writer) > 0  # the buffers it holds for the next save
    mgr.close()
    deadline = time.monotonic() + 10
    while _shm_mappings(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _shm_mappings(writer) == 0

    other = CheckpointManager(str(tmp_path / "b"), async_mode="process", handle_preemption=False)
    other.save(2, TrainState(model=model, optimizers=opt))  # the same writer, everything sent again
    other.wait()
    assert background.PROCESS._proc._save_process.pid == writer
    fresh, fresh_opt = _net()
    other.restore(TrainState(model=fresh, optimizers=fresh_opt))
    got, want = _params(fresh, fresh_opt), _params(model, opt)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    other.close()
