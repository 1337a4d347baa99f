"""Unit tests of the pure parts: fingerprint, manifest schema, sampler index math, RNG round trip."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ckpt_core import fingerprint as fp
from ckpt_core import rng
from ckpt_core.manifest import FileEntry, ManifestError, build_manifest, parse_manifest
from ckpt_core.data import ResumableDistributedSampler, epoch_permutation, rank_indices
from ckpt_core.storage import parse_step_dirname, step_dirname


# ---------------------------------------------------------------- fingerprint
def test_fingerprint_entry_is_float64_sum_abs_and_count():
    t = torch.tensor([[1.5, -2.0], [0.25, 4.0]])
    assert fp.tensor_entry(t) == (3.75, 7.75, 4)


def test_fingerprint_combines_shards_to_full_tensor():
    t = torch.randn(10, 3, dtype=torch.float64)
    parts = [{"model.w": fp.tensor_entry(t[:4])}, {"model.w": fp.tensor_entry(t[4:])}]
    s, a, n = fp.combine(parts)["model.w"]
    full = fp.tensor_entry(t)
    assert n == full[2] and math.isclose(s, full[0], rel_tol=1e-12) and math.isclose(a, full[1], rel_tol=1e-12)


def test_fingerprint_compare_reports_changes_and_tolerates_summation_order():
    t = torch.randn(1000)
    exp = {"model.w": fp.tensor_entry(t), "optim.m": (1.0, 1.0, 1)}
    reordered = {"model.w": fp.tensor_entry(t.flip(0)), "optim.m": (1.0, 1.0, 1)}
    assert fp.compare(exp, reordered) == []
    changed = t.clone()
    changed[3] += 0.5
    diffs = fp.compare(exp, {"model.w": fp.tensor_entry(changed), "optim.x": (0.0, 0.0, 1)})
    assert any(d.startswith("model.w: sum") for d in diffs)
    assert "optim.m: in the checkpoint but not restored" in diffs
    assert "optim.x: restored but not in the checkpoint's fingerprint" in diffs


def _float64_entry(t: torch.Tensor) -> tuple[float, float, int]:
    x = t.detach().reshape(-1).double()
    return (float(x.sum()), float(x.abs().sum()), x.numel())


@pytest.mark.parametrize("intra_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, (1 << 18) + 4099, 3 * (1 << 18)])
def test_fingerprint_block_sums_match_a_float64_pass(dtype, n, intra_op):
    """Rows (numpy) or blocks (torch, ``intra_op``) summed in float32, blocks added in float64: within 1e-7 of the
    sum of |x| of a float64 pass (compare's tolerance is 1e-6), for every dtype and lengths around the row (4096)
    and block (2^18) boundaries."""
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    s, a, count = fp.tensor_entry(t, intra_op)
    s64, a64, n64 = _float64_entry(t)
    assert count == n64 == n
    assert abs(s - s64) <= 1e-7 * a64 and abs(a - a64) <= 1e-7 * a64


def test_fingerprint_of_a_split_tensor_matches_the_whole_within_compare_tolerance():
    """A resharded tensor is summed in other blocks: the parts' combined entry compares equal to the whole."""
    t = torch.randn(5 * (1 << 18) + 17, generator=torch.Generator().manual_seed(1))
    parts = fp.combine([{"model.w": fp.tensor_entry(t[:777_777])}, {"model.w": fp.tensor_entry(t[777_777:])}])
    assert fp.compare({"model.w": fp.tensor_entry(t)}, parts, rtol=1e-7) == []


@pytest.mark.parametrize("intra_op", [False, True])
@pytest.mark.parametrize("n", [8192, 1 << 18, (1 << 18) + 5])
def test_fingerprint_stays_finite_where_float32_column_sums_overflow(n, intra_op):
    """64 values of 1e37 overflow a float32 column sum (float32 ends at 3.4e38); the block is summed again in
    float64, so the state is healthy (finite) exactly when a float64 pass says so."""
    t = torch.full((n,), 1e37)
    s, a, _ = fp.tensor_entry(t, intra_op)
    assert math.isfinite(s) and math.isclose(s, n * 1e37, rel_tol=1e-6) and math.isclose(a, s)
    t[5] = float("inf")
    assert fp.tensor_entry(t, intra_op)[0] == float("inf")


def test_the_restores_fingerprint_on_torchs_threads_compares_equal_to_the_saves():
    """A restore sums with torch on its intra-op threads, a save with numpy on one thread: within 1e-7 of the
    sum of |x| of each other (compare's tolerance is 1e-6); rank 1 contributes replicated tensors as zeros
    either way."""
    g = torch.Generator().manual_seed(3)
    flat = {f"model.p{i}": torch.randn(1000 + 4099 * i, generator=g) for i in range(6)}
    flat.update({"optim.step": torch.tensor(7.0), "ranks.0": torch.ones(3)})
    assert fp.compare(fp.local_entries(flat, 0, intra_op=True), fp.local_entries(flat, 0), rtol=1e-7) == []
    assert fp.local_entries(flat, 1, intra_op=True) == fp.local_entries(flat, 1) == {
        k: (0.0, 0.0, 0) for k in flat if k != "ranks.0"}


def test_nonfinite_state_is_unhealthy_but_compares_equal_to_itself():
    t = torch.tensor([1.0, float("nan")])
    e = {"model.w": fp.tensor_entry(t)}
    assert fp.compare(e, e) == []
    m = build_manifest(step=1, world_size=1, files={}, fingerprint=e)
    assert m.healthy is False
    assert build_manifest(step=1, world_size=1, files={}, fingerprint={"model.w": (1.0, 1.0, 1)}).healthy


def test_only_model_and_optimizer_are_fingerprinted():
    assert fp.is_fingerprinted("model.layer.weight")
    assert fp.is_fingerprinted("optim.state.layer.weight.exp_avg")
    assert not fp.is_fingerprinted("ranks.0")


# -------------------------------------------------------------------- manifest
def _manifest():
    return build_manifest(step=1200, world_size=4, epoch=3, permanent=True, metrics={"val_loss": 0.5},
                          files={"__0_0.distcp": FileEntry(10, 123), ".metadata": FileEntry(5, 7)},
                          fingerprint={"model.w": (1.0, 2.0, 3)}, contents={"rng": True})


def test_manifest_round_trip():
    m = _manifest()
    back = parse_manifest(m.to_json())
    assert back == m
    assert back.total_bytes == 15
    body = json.loads(m.to_json())
    assert body["format"] == "ckpt_core.manifest" and body["version"] == 2
    assert set(body["versions"]) == {"torch", "ckpt", "python"}


@pytest.mark.parametrize("text,message", [
    ("{", "not valid JSON"),
    ("[]", "not a JSON object"),
    ('{"format": "ckpt_core.manifest"}', "field 'version' is missing"),
    ('{"format": "ckpt_core.manifest", "version": 3}', "version 3 is newer than this library understands"),
    ('{"format": "ckpt_core.manifest", "version": 1, "step": 1}', "field 'world_size' is missing"),
])
def test_manifest_errors_say_what_is_wrong(text, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(text)


def test_step_directory_names():
    assert step_dirname(1000) == "step_000001000"
    assert parse_step_dirname("s3://b/run/step_000001000/") == 1000
    assert parse_step_dirname("step_12x") is None and parse_step_dirname("rolled_back") is None


# --------------------------------------------------------------------- sampler
@pytest.mark.parametrize("n,world,shuffle,drop_last", list(itertools.product(
    [1, 7, 48, 50], [1, 2, 3, 4], [True, False], [False, True])))
def test_sampler_matches_distributed_sampler(n, world, shuffle, drop_last):
    class D:
        def __len__(self):
            return n

    for epoch in (0, 3):
        for rank in range(world):
            ref = DistributedSampler(D(), num_replicas=world, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours = ResumableDistributedSampler(D(), num_replicas=world, rank=rank, shuffle=shuffle, seed=11,
                                               drop_last=drop_last)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)


@pytest.mark.parametrize("n,world,batch,steps", [(48, 2, 3, 4), (50, 4, 2, 3), (96, 3, 4, 5)])
def test_resume_at_same_world_continues_distributed_sampler_order(n, world, batch, steps):
    order = epoch_permutation(n, epoch=1, seed=5, shuffle=True)
    consumed = world * batch * steps
    for rank in range(world):
        full = rank_indices(order, 0, world, rank, drop_last=False)
        assert rank_indices(order, consumed, world, rank, drop_last=False) == full[batch * steps:]


@pytest.mark.parametrize("old,new", [(2, 1), (2, 3), (4, 2), (1, 4), (3, 5)])
def test_resume_at_other_world_sees_every_sample_once(old, new):
    n, batch, steps = 60, 2, 4
    order = epoch_permutation(n, epoch=0, seed=1, shuffle=True)
    before = [i for r in range(old) for i in rank_indices(order, 0, old, r, False)[: batch * steps]]
    consumed = old * batch * steps
    after = [i for r in range(new) for i in rank_indices(order, consumed, new, r, True)]
    remaining_padded = [i for r in range(new) for i in rank_indices(order, consumed, new, r, False)]
    assert sorted(before + after) == sorted(set(before + after))  # nothing twice
    assert sorted(set(before) | set(remaining_padded)) == list(range(n))  # nothing skipped
    assert len(remaining_padded) - (n - consumed) < new  # padding only to fill the last round


def test_sampler_state_round_trip_and_dataset_check():
    data = list(range(20))
    s = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3)
    s.set_epoch(2)
    s.advance(8)
    t = ResumableDistributedSampler(data, num_replicas=4, rank=0)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.consumed, t.seed) == (2, 8, 3)
    with pytest.raises(ValueError, match="dataset of 20 samples, this one has 3"):
        ResumableDistributedSampler([1, 2, 3], num_replicas=1, rank=0).load_state_dict(s.state_dict())


# ------------------------------------------------------------------------- RNG
def test_rng_round_trip_is_exact_and_weights_only_loadable(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    state = rng.capture()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    rng.apply(loaded)
    got = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    assert got[:4] == expected[:4]
    assert torch.equal(got[4], expected[4])


def test_rng_remap_policy():
    assert rng.remap_rng_source(0, 2) == (0, 0)
    assert rng.remap_rng_source(1, 2) == (1, 0)
    assert rng.remap_rng_source(2, 2) == (0, 1)
    assert rng.remap_rng_source(5, 2) == (1, 2)
    with pytest.raises(ValueError):
        rng.remap_rng_source(0, 0)


@pytest.mark.parametrize("async_mode", ["off", "thread"])
def test_a_save_before_the_first_optimizer_step_changes_nothing(tmp_path, async_mode):
    """DCP initialises an optimizer without state to save it; the live optimizer and one restored from that
    checkpoint still have no state, so Adam's step count and the training that follows are the run's without
    the save."""
    from ckpt_core import CheckpointManager, TrainState
    from helpers_ckpt import _train_step, assert_same_tree, tiny_model

    def run(save: bool) -> tuple[dict, dict]:
        model = tiny_model(3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if save:
            with CheckpointManager(str(tmp_path / f"ck_{async_mode}"), async_mode=async_mode,
                                   handle_preemption=False) as m:
                m.save(0, TrainState(model=model, optimizers=opt))
            assert opt.state_dict()["state"] == {}
            fresh_model = tiny_model(99)
            fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=1e-2)
            with CheckpointManager(str(tmp_path / f"ck_{async_mode}"), async_mode="off",
                                   handle_preemption=False) as m:
                assert m.restore(TrainState(model=fresh_model, optimizers=fresh_opt)).step == 0
            assert fresh_opt.state_dict()["state"] == {}
            model, opt = fresh_model, fresh_opt
        torch.manual_seed(5)
        for _ in range(3):
            _train_step(model, opt)
        return model.state_dict(), opt.state_dict()

    assert_same_tree(run(save=False), run(save=True))
