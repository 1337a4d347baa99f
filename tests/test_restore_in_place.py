"""A restore loads into the live model and optimizer tensors (``restore_in_place``, the default).

No second copy of the state is made; a load that fails half-way is
overwritten by the older checkpoint the restore falls back to; a state that
no checkpoint could replace is marked, and saving it is refused until a
restore succeeds. With ``restore_in_place=False`` the load goes into fresh
buffers and a failed restore leaves the live state as it was. After the
apply, only the tensors that moved are fingerprinted again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import hostile
from ckpt_core import CheckpointManager, OverwrittenStateError, RestoreError, TrainState, fingerprint as fp
from ckpt_core.early_sums import EarlySums
from ckpt_core.restorer import Restorer
from helpers_ckpt import assert_same_tree, restore_warned, sharded_model_factory, step_path

REPO = Path(__file__).resolve().parent.parent


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(48, 48) for _ in range(8)])  # 16 items over 4 files
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 48)).sum().backward()
    opt.step()
    opt.zero_grad()


def _save(root: Path, steps: tuple[int, ...]) -> dict[int, tuple[dict, dict]]:
    """Checkpoints at ``steps``, a training step before each: ``{step: (model state, optimizer state)}``."""
    model, opt = _model()
    state = TrainState(model=model, optimizers=opt)
    saved = {}
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False) as m:
        for step in steps:
            _train(model, opt)
            m.save(step, state)
            saved[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                           _clone(opt.state_dict()))
    return saved


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _flip(ckpt: str, fqn: str) -> None:
    """Flip a byte in the middle of the item that holds ``fqn``: its checksum fails."""
    name, offset, length = hostile.item_of(Path(ckpt), fqn)
    path = Path(ckpt, name)
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _change_value(ckpt: str, value: torch.Tensor) -> None:
    """Flip a bit of one of the saved values of ``value`` (as saved): without checksums (``verify="none"``) the
    whole checkpoint loads, and only its fingerprint tells."""
    raw = value.numpy().tobytes()
    shard = next(f for f in sorted(Path(ckpt).glob("*.distcp")) if raw in f.read_bytes())
    data = bytearray(shard.read_bytes())
    data[data.find(raw) + 403] ^= 0x40  # the top bit of one value's exponent: 2^128 times it
    shard.write_bytes(bytes(data))


def _equals(model: nn.Module, opt: torch.optim.Optimizer, expected: tuple[dict, dict]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[0][k]), k
    assert_same_tree(opt.state_dict(), expected[1])


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, TrainState]:
    model, opt = _model(seed=99)
    _train(model, opt)  # live optimizer state: a restore in the middle of a run
    return model, opt, TrainState(model=model, optimizers=opt)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_restore_loads_into_the_live_tensors_or_into_fresh_buffers(tmp_path, monkeypatch, in_place):
    saved = _save(tmp_path / "run", (10,))
    model, opt, state = _fresh()
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *_tensors(opt.state)]}
    targets: list[dict] = []
    real = TrainState.load_template

    def recording(self, *args, **kwargs):
        template, wanted = real(self, *args, **kwargs)
        targets.append(template)
        return template, wanted

    monkeypatch.setattr(TrainState, "load_template", recording)
    info, said = restore_warned(tmp_path / "run", state, restore_in_place=in_place)
    assert info.step == 10
    _equals(model, opt, saved[10])
    loaded = [t.untyped_storage().data_ptr() for t in _tensors({k: targets[0][k] for k in ("model", "optim")})]
    assert len(loaded) == 16 + 32 + 16  # weights and biases; AdamW's exp_avg, exp_avg_sq and step of each
    shared = [p for p in loaded if p in live]
    if in_place:
        assert len(shared) == len(loaded)
    else:
        assert shared == []


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_a_load_that_failed_half_way_is_overwritten_by_the_checkpoint_it_falls_back_to(tmp_path, monkeypatch):
    saved = _save(tmp_path / "run", (10, 20))
    _change_value(step_path(tmp_path / "run", 20), saved[20][0]["6.weight"])
    model, opt, state = _fresh()
    at_fallback: list[dict] = []
    real = Restorer._fall_back

    def recording(self, *args, **kwargs):
        at_fallback.append({k: v.clone() for k, v in model.state_dict().items()})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Restorer, "_fall_back", recording)
    info, said = restore_warned(tmp_path / "run", state, verify="none")
    assert info.step == 10 and "step 20" in said and "model.6.weight: sum" in said, said
    # the failed attempt had loaded all of step 20 into the live tensors, the changed value too
    written = {k for k, v in at_fallback[0].items() if torch.equal(v, saved[20][0][k])}
    assert written == set(saved[20][0]) - {"6.weight"}, written
    _equals(model, opt, saved[10])
    with CheckpointManager(str(tmp_path / "run"), async_mode="off", handle_preemption=False) as m:
        assert m.save(30, state)  # a restored state is saved


def test_a_state_no_checkpoint_replaced_is_marked_and_never_saved_until_a_restore_succeeds(tmp_path):
    saved = _save(tmp_path / "run", (20,))
    ckpt = step_path(tmp_path / "run", 20)
    _flip(ckpt, "model.7.weight")
    model, opt, state = _fresh()
    with CheckpointManager(str(tmp_path / "run"), async_mode="off", handle_preemption=False) as m:
        with pytest.warns(UserWarning, match="step 20"):
            with pytest.raises(RestoreError, match=r"partly overwritten by the restore of step 20 from .*step_000000020"):
                m.restore(state)
    other = tmp_path / "other"
    with CheckpointManager(str(other), async_mode="off", handle_preemption=False, every_n_steps=10) as m:
        with pytest.raises(OverwrittenStateError, match=r"not saving step 30: .*restore of step 20"):
            m.save(30, TrainState(model=model, optimizers=opt))  # another manager, on another root
        assert m.maybe_save(41, TrainState(model=model, optimizers=opt)) is False  # nothing due: no error
        with pytest.raises(OverwrittenStateError):
            m.maybe_save(50, TrainState(model=model, optimizers=opt))
    assert not any(other.glob("step_*"))
    _flip(ckpt, "model.7.weight")  # repaired
    with CheckpointManager(str(tmp_path / "run"), async_mode="off", handle_preemption=False) as m:
        assert m.restore(state).step == 20
    _equals(model, opt, saved[20])
    with CheckpointManager(str(other), async_mode="off", handle_preemption=False) as m:
        assert m.save(30, state)
    assert (other / "step_000000030" / "manifest.json").exists()


def test_an_explicit_restore_that_fails_after_writing_says_so_and_blocks_saving(tmp_path):
    _save(tmp_path / "run", (10, 20))
    _flip(step_path(tmp_path / "run", 20), "model.7.weight")
    model, opt, state = _fresh()
    with CheckpointManager(str(tmp_path / "run"), async_mode="off", handle_preemption=False) as m:
        with pytest.raises(RestoreError, match=r"step 20\) is not usable: .*partly overwritten"):
            m.restore(state, step=20)
        with pytest.raises(OverwrittenStateError):
            m.save(30, state)
        assert m.restore(state, step=10).step == 10
        assert m.save(30, state)


def test_with_restore_in_place_off_a_failed_restore_leaves_the_live_state_as_it_was(tmp_path):
    _save(tmp_path / "run", (20,))
    _flip(step_path(tmp_path / "run", 20), "model.7.weight")
    model, opt, state = _fresh()
    before = ({k: v.clone() for k, v in model.state_dict().items()}, _clone(opt.state_dict()))
    with CheckpointManager(str(tmp_path / "run"), async_mode="off", handle_preemption=False,
                           restore_in_place=False) as m:
        with pytest.warns(UserWarning, match="step 20"):
            with pytest.raises(RestoreError) as caught:
                m.restore(state)
        assert "overwritten" not in str(caught.value)
        _equals(model, opt, before)
        assert m.save(30, state)


# ------------------------------------------------------------------- fingerprint
def _summing(monkeypatch) -> tuple[list[set], list[set]]:
    """The tensors each fingerprint pass sums (not kept from the pass before), and those each load summed while
    it read (``EarlySums``)."""
    passes: list[set] = []
    early: list[set] = []
    real, real_entries = fp._entries, EarlySums.entries

    def recording(jobs, workers):
        passes.append(set(jobs))
        return real(jobs, workers)

    def recording_early(self):
        out = real_entries(self)
        early.append(set(out))
        return out

    monkeypatch.setattr(fp, "_entries", recording)
    monkeypatch.setattr(EarlySums, "entries", recording_early)
    return passes, early


@pytest.mark.parametrize("in_place", [True, False])
def test_after_the_apply_only_the_tensors_that_moved_are_summed_again(tmp_path, monkeypatch, in_place):
    saved = _save(tmp_path / "run", (10,))
    model, opt, state = _fresh()
    passes, early = _summing(monkeypatch)
    info, _ = restore_warned(tmp_path / "run", state, restore_in_place=in_place)
    assert info.step == 10
    _equals(model, opt, saved[10])
    loaded = {f"model.{k}" for k in model.state_dict()} | {
        f"optim.state.{k}.{s}" for k in dict(model.named_parameters()) for s in ("exp_avg", "exp_avg_sq", "step")}
    assert early == [loaded]  # while the load read: every tensor, each once its bytes were in and checked
    assert passes[0] == set()  # after the load: nothing left
    if in_place:
        assert passes[1] == set()  # after the apply: every tensor is still where it was loaded
    else:  # the model's fresh buffers were copied into the parameters: summed again there; the optimizer kept its
        assert passes[1] == {f"model.{k}" for k in model.state_dict()}


class _Odd(nn.Module):
    """Tied weights (one tensor under two names) and a transposed, non-contiguous weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Parameter(torch.randn(24, 16).t())
        self.norm = nn.LayerNorm(16)


def test_tied_and_non_contiguous_tensors_are_summed_after_the_load(tmp_path, monkeypatch):
    """A tensor that another name also writes into, or that DCP's own path fills, is summed once the load is
    done; the rest while it reads."""
    torch.manual_seed(0)
    saved = _Odd()
    with CheckpointManager(tmp_path / "run", async_mode="off", handle_preemption=False) as m:
        m.save(10, TrainState(model=saved))
    live = _Odd()
    passes, early = _summing(monkeypatch)
    with CheckpointManager(tmp_path / "run", async_mode="off", handle_preemption=False) as m:
        assert m.restore(TrainState(model=live)).step == 10
    assert_same_tree(live.state_dict(), saved.state_dict())
    assert early == [{"model.norm.weight", "model.norm.bias"}]
    assert passes[0] == {"model.embed.weight", "model.head.weight", "model.proj"}


def test_a_value_changed_on_storage_is_caught_by_the_fingerprint_of_the_live_tensors(tmp_path):
    """Without checksums (``verify="none"``), the fingerprint alone catches a changed weight, loaded into the live
    tensor; the restore falls back to the intact checkpoint, which overwrites it."""
    saved = _save(tmp_path / "run", (10, 20))
    _change_value(step_path(tmp_path / "run", 20), saved[20][0]["6.weight"])
    model, opt, state = _fresh()
    info, said = restore_warned(tmp_path / "run", state, verify="none")
    assert info.step == 10 and "step 20" in said and "model.6.weight: sum" in said, said
    _equals(model, opt, saved[10])


# --------------------------------------------------------------------- memory
_RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from torch import nn
    from ckpt_core import CheckpointManager, TrainState

    root, in_place = sys.argv[1], sys.argv[2] == "1"
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)])  # 256 MiB
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with CheckpointManager(root, async_mode="off", handle_preemption=False, restore_in_place=in_place) as m:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from the current RSS
        before = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
        step = m.restore(TrainState(model=model)).step
        peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    print(json.dumps({"step": step, "added": (peak - before) / nbytes}))
""")


def test_a_restore_in_place_adds_a_fraction_of_the_memory_a_restore_into_fresh_buffers_adds(tmp_path):
    """Peak RSS a restore adds, over the state's bytes, in a fresh process (256 MiB, 1 rank): in place, the read
    buffers only; into fresh buffers, a whole second copy of the state."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)])
    with CheckpointManager(str(tmp_path / "run"), async_mode="off", handle_preemption=False) as m:
        m.save(7, TrainState(model=model))
    del model
    added = {}
    for in_place in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "run"), in_place], cwd=REPO,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr[-3000:]
        facts = json.loads(out.stdout.strip().splitlines()[-1])
        assert facts["step"] == 7
        added[in_place] = facts["added"]
    assert added["1"] < 0.35 and added["0"] > 0.9, added


# -------------------------------------------------------------------- 4 ranks
def _sharded_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    """DTensor shards at 4 ranks: a newest checkpoint damaged in rank 2's shard only; facts per rank."""
    import torch.distributed as dist

    model = sharded_model_factory(rank, world, port, 64, 96, 1001)
    kw = dict(async_mode="off", handle_preemption=False, collective_timeout_s=60)
    saved, shards = model(0), {}
    with CheckpointManager(root, **kw) as m:
        for step in (10, 20):
            with torch.no_grad():
                for p in saved.parameters():
                    p.add_(step)
            m.save(step, TrainState(model=saved))
            shards[step] = [p.to_local().clone() for p in saved.parameters()]
    dist.barrier()
    if rank == 0:
        _flip_chunk(step_path(root, 20), "model.w", (2 * 16, 0))  # rank 2's rows of w
    dist.barrier()
    live = model(1)
    at_fallback: list = []
    real = Restorer._fall_back
    Restorer._fall_back = lambda self, *a: (at_fallback.append([p.to_local().clone() for p in live.parameters()]),
                                            real(self, *a))[1]
    facts: dict = {}
    try:
        with CheckpointManager(root, **kw) as m:
            facts["auto"] = m.restore(TrainState(model=live)).step
    finally:
        Restorer._fall_back = real
    facts["exact"] = all(torch.equal(a, b) for a, b in zip(shards[10], [p.to_local() for p in live.parameters()]))
    facts["wrote_20"] = any(torch.equal(a, b) for a, b in zip(shards[20], at_fallback[0]))
    with CheckpointManager(root, **kw) as m:
        try:
            m.restore(TrainState(model=live), step=20)
        except RestoreError as e:
            facts["explicit"] = "partly overwritten" in str(e)
        try:
            m.save(30, TrainState(model=live))
        except OverwrittenStateError:
            facts["refused"] = True
        facts["again"] = m.restore(TrainState(model=live), step=10).step
        facts["early"] = m._restorer.summed_early  # local shards summed while the load read
        facts["saved"] = m.save(30, TrainState(model=live))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


def _flip_chunk(ckpt: str, fqn: str, offset: tuple) -> None:
    from ckpt_core.dcp_io import read_metadata

    md = read_metadata(str(ckpt))
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn and tuple(k.offset) == offset)
    path = Path(ckpt, os.path.basename(str(info.relative_path)))
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01  # inside the shard's values: its checksum fails
    path.write_bytes(bytes(data))


def test_at_4_ranks_one_ranks_damaged_shard_makes_every_rank_fall_back_and_refuse_a_mixed_state(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_sharded_worker, args=(4, free_port(), str(tmp_path / "run"), str(tmp_path)), nprocs=4, join=True)
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, f in enumerate(facts):
        assert f["auto"] == 10 and f["exact"], (rank, f)
        assert f["explicit"] and f.get("refused") and f["again"] == 10 and f["saved"], (rank, f)
        assert f["early"] == 2, (rank, f)  # w and v: the fingerprint matched with the sums taken while reading
    # the ranks whose own shards were intact had loaded step 20 into their live shards before the fallback
    assert [f["wrote_20"] for f in facts if f is not facts[2]] == [True, True, True], facts
    assert (tmp_path / "run" / "step_000000030" / "manifest.json").exists()
