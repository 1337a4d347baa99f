"""Resharding: FSDP2 saved at world size 2, restored at 1 and 4: same full tensors, same global data order."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import WORKERS, run_script

SCRIPT = WORKERS / "fsdp_reshard.py"


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    run_script(SCRIPT, ["--root", str(d / "ckpt"), "--phase", "save", "--save-step", "5", "--out", str(d / "save")],
               nproc=2)
    return d


def _damaged_copy(saved, root):
    """``saved``'s checkpoints with a flipped byte in the item only ranks 1 and 3 of 4 read (rank 1's blob of the
    2-rank save), beside an intact copy of step 5 under another label."""
    import shutil

    from ckpt_core.dcp_io import read_metadata

    shutil.copytree(saved / "ckpt", root)
    good = root / "step_000000005"
    shutil.copytree(good, root / "checkpoint_1")  # an intact copy of step 5 under another label
    info = next(i for idx, i in read_metadata(str(good)).storage_data.items() if idx.fqn == "ranks.1")
    shard = good / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 64] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def resumed_at_4(saved, tmp_path_factory):
    """One 4-rank launch, two resumes: the intact 2-rank save (``saved / "resume4"``), then a damaged copy of it
    (``(d / "damaged_out")``), in the same processes with a fresh model, optimizer, loader and manager."""
    d = tmp_path_factory.mktemp("resume4")
    _damaged_copy(saved, d / "damaged")
    proc = run_script(SCRIPT, ["--root", str(saved / "ckpt"), "--phase", "resume", "--out", str(saved / "resume4"),
                               "--also", str(d / "damaged"), str(d / "damaged_out")], nproc=4, torchrun=True)
    return d, proc


@pytest.mark.parametrize("world", [1, 4])
def test_fsdp2_reshard_restores_same_full_state_and_data_order(saved, world, request):
    out = saved / f"resume{world}"
    if world == 4:
        request.getfixturevalue("resumed_at_4")
    else:
        run_script(SCRIPT, ["--root", str(saved / "ckpt"), "--phase", "resume", "--out", str(out)], nproc=world,
                   torchrun=True)
    before, after = torch.load(saved / "save.pt"), torch.load(f"{out}.pt")
    fb, fa = _flat(before["model"]), _flat(after["model"])
    assert fb.keys() == fa.keys() and fb
    for k in fb:
        assert torch.equal(fb[k], fa[k]), k
    ob, oa = _flat(before["optim"]["state"]), _flat(after["optim"]["state"])
    assert ob.keys() == oa.keys() and ob
    for k in ob:
        assert torch.equal(ob[k], oa[k]), k
    seen_before = json.load(open(saved / "save.json"))["seen"]
    seen_after = json.load(open(f"{out}.json"))["seen"]
    assert len(seen_before) == 5 * 2 * 2  # 5 steps x batch 2 x 2 ranks
    # every sample of the epoch exactly once across the world-size change
    assert sorted(seen_before + seen_after) == list(range(48))


def test_damaged_item_read_by_some_ranks_only_makes_every_rank_fall_back(saved, resumed_at_4):
    """At 4 ranks from a 2-rank save, only ranks 1 and 3 read rank 1's blob: a flipped byte there is caught
    by the per-item checksum on those ranks, and all four ranks fall back to the same (intact) copy."""
    d, proc = resumed_at_4
    # the damaged root is the launch's second resume: the intact first one reports no unusable checkpoint
    assert f"{saved / 'ckpt' / 'step_000000005'} (step 5) is not usable" not in proc.stderr
    assert "step_000000005 (step 5) is not usable" in proc.stderr and "fail their checksum" in proc.stderr
    assert f"{d / 'damaged' / 'step_000000005'} (step 5) is not usable" in proc.stderr
    # the failed load leaves nothing that holds the manager's process groups: close() joined their threads
    for out in (saved / "resume4", d / "damaged_out"):
        threads = json.load(open(f"{out}.json"))["threads"]
        assert len(threads) == 4 and all(after == before for before, after in threads), (out, threads)
    restored = torch.load(f"{d / 'damaged_out'}.pt")
    before = torch.load(saved / "save.pt")
    for k, v in _flat(before["model"]).items():
        assert torch.equal(v, _flat(restored["model"])[k]), k
