"""Checkpoints on S3: a real S3-protocol server (moto's server mode) on loopback, through s3fs."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from benchmarks._common import MotoS3
from ckpt_core import CheckpointManager, TrainState
from ckpt_core.discovery import list_records
from conftest import EXAMPLES, load_result, run_script

s3fs = pytest.importorskip("s3fs", reason="the s3 extra is part of the test install")


@pytest.fixture(scope="module")
def s3_server():
    try:
        server = MotoS3(bucket="ckpts")
    except RuntimeError as e:
        pytest.fail(str(e))
    with server:
        yield server.options


def _model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def test_save_list_restore_retention_on_s3(s3_server):
    root = "s3://ckpts/run1"
    model, opt = _model(0)
    state = TrainState(model=model, optimizers=opt)
    weights = {}
    with CheckpointManager(root, async_mode="thread", keep_last=2, keep_every_n_steps=20,
                           storage_options=s3_server, handle_preemption=False) as m:
        for step in (10, 20, 30, 40, 50):
            model(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
            m.save(step, state)
            weights[step] = [p.detach().clone() for p in model.parameters()]
            m.wait()
    recs = list_records(root, s3_server)
    assert [(r.step, r.committed, r.permanent) for r in recs] == [(20, True, True), (40, True, True), (50, True, False)]
    fs = s3fs.S3FileSystem(**s3_server)
    assert not fs.exists("ckpts/run1/step_000000010")  # deleted remotely, not just locally
    assert not fs.exists("ckpts/run1/step_000000030")
    fresh, fresh_opt = _model(1)
    with CheckpointManager(root, async_mode="off", verify="checksum", storage_options=s3_server,
                           handle_preemption=False) as m:
        assert m.restore(TrainState(model=fresh, optimizers=fresh_opt)).step == 50
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), weights[50]))

    # a checkpoint whose manifest never arrived is not committed and never loaded
    fs.rm("ckpts/run1/step_000000050/manifest.json")
    fs.invalidate_cache()
    fresh, fresh_opt = _model(2)
    with CheckpointManager(root, async_mode="off", storage_options=s3_server, handle_preemption=False) as m:
        assert m.restore(TrainState(model=fresh, optimizers=fresh_opt)).step == 40
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), weights[40]))

    # a truncated shard (as an interrupted multipart upload would leave) falls back with a reason
    shard = next(p for p in fs.ls("ckpts/run1/step_000000040") if p.endswith(".distcp"))
    fs.pipe_file(shard, fs.cat_file(shard)[:-10])
    fs.invalidate_cache()
    with pytest.warns(UserWarning, match=r"step 40.*has \d+ bytes, the manifest says"):
        with CheckpointManager(root, async_mode="off", storage_options=s3_server, handle_preemption=False) as m:
            assert m.restore(TrainState(model=fresh, optimizers=fresh_opt)).step == 20


def test_bit_exact_resume_on_s3_with_background_process(s3_server, tmp_path, core_reference):
    """The core example trains, is SIGKILLed, and resumes from S3 with DCP's background writer process; it ends
    as the uninterrupted run (which saved locally: where checkpoints go never changes the numbers)."""
    import json

    opts = json.dumps(s3_server)
    reference = core_reference(1, "--steps", "40", "--every", "10")  # test_core_resume.py's too
    common = ["--steps", "40", "--every", "10", "--async-mode", "process", "--storage-options", opts]
    killed = run_script(EXAMPLES / "core_train.py", ["--root", "s3://ckpts/b", "--kill-at-step", "24", *common],
                        check=False)
    assert killed.returncode == -9  # SIGKILL
    run_script(EXAMPLES / "core_train.py", ["--root", "s3://ckpts/b", "--out", str(tmp_path / "b"), *common])
    ref, ref_state = load_result(reference)
    got, state = load_result(tmp_path / "b")
    assert got["resumed_from"] in (10, 20)
    assert sorted(int(s) for s in got["losses"]) == list(range(got["resumed_from"] + 1, 41))
    assert all(got["losses"][s] == ref["losses"][s] for s in got["losses"])
    assert all(torch.equal(ref_state["model"][k], state["model"][k]) for k in ref_state["model"])


def test_the_lease_on_s3_uses_a_conditional_create(s3_server):
    """Two jobs racing for one generation on a real S3-protocol server: If-None-Match lets exactly one create it;
    a second manager with another run id is then refused, naming the holder."""
    import threading

    from ckpt_core import LeaseHeldError
    from ckpt_core import lease as L

    fs = s3fs.S3FileSystem(**s3_server)
    files = L.LeaseFiles(fs, "ckpts/lease-race")
    won: dict[int, bool] = {}
    barrier = threading.Barrier(4)

    def take(i: int) -> None:
        rec = L.LeaseRecord(run_id=f"job-{i}", holder=f"{i:032d}", host="h", machine="h|b|p", pid=1, pid_start=0,
                            started=time.time(), refreshed=time.time(), ttl_s=120.0, generation=1)
        barrier.wait()
        won[i] = L.LeaseFiles(s3fs.S3FileSystem(**s3_server, skip_instance_cache=True), "ckpts/lease-race").create(rec)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in won.items() if ok]
    current, top, _ = files.current()
    assert len(won) == 4 and len(winners) == 1 and top == 1 and current.run_id == f"job-{winners[0]}"
    root = "s3://ckpts/leased"
    with CheckpointManager(root, async_mode="off", every_n_steps=1, run_id="job-a", storage_options=s3_server,
                           handle_preemption=False, env={}, argv=[]) as m:
        assert m.save(1, TrainState(model=nn.Linear(2, 2), rng=False))
    files = L.LeaseFiles(fs, "ckpts/leased")
    assert files.current() == (None, 0, None)  # released at close: deleted
    assert files.create(replace(current, run_id="job-a", refreshed=time.time(), machine="elsewhere|boot|pid:[1]"))
    with pytest.raises(LeaseHeldError, match="in use by another job: run 'job-a'"):  # job A, live on another machine
        CheckpointManager(root, async_mode="off", every_n_steps=1, run_id="job-b", storage_options=s3_server,
                          handle_preemption=False, env={}, argv=[])
