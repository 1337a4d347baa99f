"""The local tier in one process: its pure decisions, its record parser, and a real manager's snapshots.

Several ranks and nodes, SIGKILL and replication are in ``test_local_tier_e2e.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import namedtuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_core import CheckpointManager, TrainState
from ckpt_core import local_layout as layout
from ckpt_core import local_snapshot as snap
from ckpt_core.local_tier import LocalTierError, job_key
from helpers_ckpt import _train_step, assert_same_tree, tiny_model

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- pure decisions
@st.composite
def layouts(draw):
    node_size = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, 5))
    factor = draw(st.integers(1, nodes))
    return node_size * nodes, node_size, factor


@FAST
@given(layouts())
def test_replicas_go_to_distinct_other_nodes_and_sources_mirror_targets(lay):
    world, node_size, factor = lay
    assert layout.layout_problem(world, node_size, factor) is None
    for r in range(world):
        targets = layout.replica_targets(r, world, node_size, factor)
        assert len(targets) == factor - 1
        nodes = {layout.node_of(t, node_size) for t in targets} | {layout.node_of(r, node_size)}
        assert len(nodes) == factor  # every copy on its own node
        for t in targets:
            assert r in layout.replica_sources(t, world, node_size, factor)
    # every rank's scanning share covers each owner exactly once per node
    for node in range(world // node_size):
        ranks = range(node * node_size, (node + 1) * node_size)
        shares = sorted(o for r in ranks for o in layout.owners_scanned_by(r, world, node_size))
        assert shares == list(range(world))


def test_layout_problems_name_the_setting_to_change():
    assert "local_node_size" in layout.layout_problem(6, 4, 1)
    assert "replication_factor <= 2" in layout.layout_problem(4, 2, 3)
    assert layout.default_factor(4, 2) == 2 and layout.default_factor(4, 4) == 1


holdings_st = st.lists(st.builds(layout.Holding, st.integers(0, 3), st.integers(0, 5), st.integers(0, 3)),
                       max_size=40)


@FAST
@given(holdings_st, st.one_of(st.none(), st.integers(0, 6)),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1)), max_size=4))
def test_recovery_takes_the_newest_step_every_rank_can_be_restored_from(holdings, not_below, excluded):
    world, node_size = 4, 2
    got = layout.choose_recovery(holdings, world, node_size, not_below, excluded)
    usable = {(h.owner, h.step, h.holder) for h in holdings
              if (h.owner, layout.node_of(h.holder, node_size)) not in set(excluded)}
    restorable = [s for s in range(6) if all(any((o, s, h) in usable for h in range(4)) for o in range(world))]
    want = max(restorable, default=None)
    if want is not None and not_below is not None and want < not_below:
        want = None
    assert (got[0] if got else None) == want
    if got is not None:
        step, sources = got
        for owner, src in sources.items():
            assert (owner, step, src) in usable or (
                src == owner and any((owner, step, h) in usable and layout.node_of(h, node_size) ==
                                     layout.node_of(owner, node_size) for h in range(4)))


@FAST
@given(st.integers(1, 4), st.lists(st.integers(0, 100), min_size=1, max_size=30, unique=True))
def test_a_new_snapshot_never_overwrites_one_of_the_newest_kept(keep, steps):
    slots = {k: None for k in range(keep + 1)}
    for step in steps:
        newest_kept = sorted((s for s in slots.values() if s is not None), reverse=True)[:keep]
        k = layout.slot_to_reuse(slots)
        assert slots[k] not in newest_kept or slots[k] is None
        slots[k] = step


# ----------------------------------------------------------------- record parser
def _record_body(**changes) -> dict:
    rec = snap.SnapshotRecord("job-x", 0, 2, 8, 1, 0, 128, 7, 10, 20, 9, "[1, {}]",
                              (snap.TensorEntry(0, "float32", (4, 4), 0, 64, (1.0, 2.0, 16)),
                               snap.TensorEntry(1, "bfloat16", (3,), 64, 6, (0.0, 0.0, 3))), 1.5)
    return {**json.loads(rec.to_json()), **changes}


def test_a_valid_record_round_trips():
    body = _record_body()
    rec = snap.parse_record(json.dumps(body).encode(), "r")
    assert rec.to_json() == snap.SnapshotRecord(**{**rec.__dict__}).to_json()
    assert rec.tensors[1].dtype == "bfloat16" and rec.tensors[0].fingerprint == (1.0, 2.0, 16)


@pytest.mark.parametrize("changes,why", [
    ({"tensors": [[0, "float32", [4, 4], 0, 64, [1, 2, 16]], [1, "float32", [10**12], 64, 4 * 10**12, [0, 0, 1]]]},
     "does not fit"),
    ({"tensors": [[0, "object", [1], 0, 8, [0, 0, 1]]]}, "unknown dtype"),
    ({"tensors": [[0, "float32", [4], 3, 16, [0, 0, 4]]]}, "does not fit"),
    ({"owner": 5}, "out of range"),
    ({"version": 2}, "not a version-1"),
    ({"step": -1}, "'step'"),
    ({"tensors": "x"}, "'tensors'"),
])
def test_a_malformed_record_is_refused_with_the_field_named(changes, why):
    with pytest.raises(snap.SnapshotError, match=why):
        snap.parse_record(json.dumps(_record_body(**changes)).encode(), "r")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=15)


@FAST
@given(st.sampled_from(sorted(_record_body())), json_values)
def test_any_record_parses_or_raises_snapshot_error(key, value):
    body = _record_body(**{key: value})
    try:
        snap.parse_record(json.dumps(body).encode(), "r")
    except snap.SnapshotError:
        pass


# ----------------------------------------------------------------- a real manager, one process
Run = namedtuple("Run", "model opt sched state")


def _run(seed: int = 0) -> Run:
    torch.manual_seed(seed)
    model = tiny_model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    return Run(model, opt, sched, TrainState(model, opt, sched))


def _manager(tmp_path, **kw) -> CheckpointManager:
    opts = dict(every_n_steps=5, local_every_n_steps=2, local_dir=str(tmp_path / "local"), run_id="job-a",
                async_mode="off", env={}, argv=[], lease=False)
    return CheckpointManager(str(tmp_path / "root"), **{**opts, **kw})


def _train(run: Run, m: CheckpointManager, start: int, stop: int) -> None:
    for step in range(start + 1, stop + 1):
        _train_step(run.model, run.opt, run.sched)
        m.maybe_save(step, run.state)


def _crash(m: CheckpointManager) -> None:
    """Leave as a killed process would: snapshots committed, nothing closed or cleaned."""
    m.wait()
    m._local._pool.shutdown()
    m._closed = True


def _snapshot_state(run: Run) -> dict:
    import copy

    return copy.deepcopy({"model": run.model.state_dict(), "optim": run.opt.state_dict(),
                          "sched": run.sched.state_dict(), "rng": torch.get_rng_state()})


def test_a_restart_resumes_from_node_memory_exactly(tmp_path, caplog):
    ref = _run()
    with _manager(tmp_path / "ref", local_every_n_steps=None) as m:
        _train(ref, m, 0, 6)
        at6 = _snapshot_state(ref)
        _train(ref, m, 6, 9)
    first = _run()
    m = _manager(tmp_path)
    _train(first, m, 0, 7)
    _crash(m)
    second = _run(seed=99)  # a fresh process: other initial weights and RNG
    with caplog.at_level(logging.INFO, logger="ckpt_core"), _manager(tmp_path) as m:
        info = m.resume(second.state)
        assert info.step == 6 and m.resumed_from == 6
        assert set(m.last_restore_timings) == {"discover", "load", "apply", "verify"}
        assert_same_tree(at6, _snapshot_state(second))
        _train(second, m, 6, 9)
    assert "resumed from the local tier at step 6 (durable tier's newest: step 5)" in caplog.text
    assert_same_tree(_snapshot_state(ref), _snapshot_state(second))
    assert not list((tmp_path / "local").glob("job-*/rank_*/*"))  # the clean end removed them


def test_a_failed_run_keeps_its_snapshots_and_a_resume_at_the_durable_step_drops_newer_ones(tmp_path):
    run = _run()
    with pytest.raises(RuntimeError, match="boom"), _manager(tmp_path) as m:
        _train(run, m, 0, 4)
        raise RuntimeError("boom")
    kept = sorted(p.name for p in (tmp_path / "local").glob("job-*/rank_0/step_*.json"))
    assert kept == ["step_2.json", "step_4.json"]
    other = _run()
    with _manager(tmp_path, local_every_n_steps=None) as m:  # a run without the local tier: nothing to do there
        assert m.resume(other.state) is None
    again = _run()
    m = _manager(tmp_path, every_n_steps=1)
    _train(again, m, 0, 3)  # from scratch (no durable checkpoint, snapshot 4 of a run that did not continue)
    _crash(m)
    steps = sorted(p.name for p in (tmp_path / "local").glob("job-*/rank_0/step_*.json"))
    assert steps == ["step_2.json"], "a snapshot of the abandoned run survived"
    last = _run()
    with _manager(tmp_path) as m:
        assert m.resume(last.state).step == 3  # the durable tier's step 3 is newer than the snapshot of step 2


def test_a_snapshot_of_another_model_falls_back_to_the_durable_tier(tmp_path, caplog):
    run = _run()
    m = _manager(tmp_path)
    _train(run, m, 0, 6)
    _crash(m)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"), _manager(tmp_path) as m2:
        with pytest.raises(Exception, match="does not fit this model"):
            m2.resume(TrainState(model, opt, sched))  # the durable tier says so too, naming the shapes
    assert "local snapshot of rank 0 at step 6 on node 0 is not usable" in caplog.text
    assert "leaf" in caplog.text and "float32[4, 5]" in caplog.text


def test_a_flipped_byte_in_node_memory_falls_back_to_the_durable_tier(tmp_path, caplog):
    run = _run()
    m = _manager(tmp_path)
    _train(run, m, 0, 6)
    _crash(m)
    (rec,) = [p for p in (tmp_path / "local").glob("job-*/rank_0/step_6.json")]
    slot = rec.parent / f"slot_{json.loads(rec.read_text())['slot']}.data"
    data = bytearray(slot.read_bytes())
    data[10] ^= 1
    slot.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ckpt_core"), _manager(tmp_path) as m2:
        assert m2.resume(_run(seed=5).state).step == 5
    assert "the data fails its checksum (crc32c)" in caplog.text


def test_no_room_in_local_dir_is_an_error_before_training_starts(tmp_path, monkeypatch):
    """As in a container whose /dev/shm is 64 MiB: the error names the directory, the need and the way out."""
    import ckpt_core.local_tier as lt

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(lt.shutil, "disk_usage", lambda p: usage._replace(free=64 << 20))
    big = torch.nn.Linear(4096, 4096)  # 64 MiB of weights, 128 MiB more of Adam state
    state = TrainState(big, torch.optim.Adam(big.parameters()))
    with _manager(tmp_path) as m:
        with pytest.raises(LocalTierError, match=r"has 64 MiB free, the local tier needs \d+ MiB.*--shm-size"):
            m.resume(state)


def _state_nbytes(run) -> int:
    from ckpt_core.saver import state_bytes

    return state_bytes(run.state)


def _snapshot_nbytes(run) -> int:
    cap = snap.capture(run.state)
    return cap.data_bytes + len(cap.small) + len(cap.others)


def test_slots_beyond_the_host_memory_budget_are_an_error_before_training_starts(tmp_path):
    """(local_keep + 1) x factor x state of slots against max_host_memory_bytes: refused at start, by name."""
    run = _run()
    with _manager(tmp_path, max_host_memory_bytes=_snapshot_nbytes(run)) as m:  # 2 slots of 1x state > 1x
        with pytest.raises(LocalTierError, match=r"need \d+ bytes of host memory per rank \(\(local_keep 1 \+ 1\) "
                                                 r"x 1 copies.*max_host_memory_bytes"):
            m.resume(run.state)
    assert not list((tmp_path / "local").glob("job-*/rank_0/slot_*"))


def test_durable_staging_goes_synchronous_when_the_slots_fill_the_budget(tmp_path, caplog):
    """The slots fit (2x state) but not with the durable tier's staging copy (1x more): durable saves are
    synchronous, the log says why, and the snapshots go on."""
    run = _run()
    nbytes, slots = _state_nbytes(run), 2 * _snapshot_nbytes(run)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"), \
            _manager(tmp_path, async_mode="thread", max_host_memory_bytes=slots + nbytes // 2) as m:
        m.resume(run.state)
        _train(run, m, 0, 5)
        assert m._saver.inflight is None  # step 5 was durable when maybe_save returned
        assert len(m._saver.stager._state_dict_stager._cached_storage_mapping) == 0  # nothing staged
        assert m._local.steps == [2, 4]
    assert f"with the local tier's {slots} bytes of slots exceeds max_host_memory_bytes" in caplog.text


def test_a_budget_with_room_for_slots_and_staging_keeps_saves_asynchronous(tmp_path, caplog):
    run = _run()
    nbytes = _state_nbytes(run)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"), \
            _manager(tmp_path, async_mode="thread", max_host_memory_bytes=2 * _snapshot_nbytes(run) + nbytes) as m:
        m.resume(run.state)
        _train(run, m, 0, 5)
        assert len(m._saver.stager._state_dict_stager._cached_storage_mapping) > 0  # staged
    assert "max_host_memory_bytes" not in caplog.text


def test_ranks_not_laid_out_by_node_are_refused(tmp_path, monkeypatch):
    """torchrun's GROUP_RANK says the node; LOCAL_WORLD_SIZE-based placement must put the rank on that node,
    else replicas could land on the node they protect (nodes with different rank counts)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_RANK", "1")
    with _manager(tmp_path) as m:
        with pytest.raises(LocalTierError, match=r"rank 0 runs on node 1 \(GROUP_RANK\).*same number of ranks"):
            m.resume(_run().state)
    monkeypatch.setenv("GROUP_RANK", "0")
    with _manager(tmp_path) as m:
        assert m.resume(_run().state) is None


def test_a_local_dir_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with _manager(tmp_path, local_dir=str(shared)) as m:
        with pytest.raises(LocalTierError, match="others cannot write"):
            m.resume(_run().state)


def test_the_job_directory_depends_on_the_job_id_only():
    assert job_key("slurm:17") == job_key("slurm:17") != job_key("slurm:18")


def test_a_completed_close_after_a_plain_close_still_removes_the_snapshots(tmp_path):
    """``plugin.close()`` then ``accelerator.end_training()`` (Accelerate's examples): the second, completed close
    finds the manager closed and must still remove the job's snapshots."""
    run = _run()
    m = _manager(tmp_path)
    _train(run, m, 0, 4)
    m.close()
    assert len(list((tmp_path / "local").glob("job-*/rank_0/step_*.json"))) == 2
    m.close(completed=True)
    assert not list((tmp_path / "local").glob("job-*/rank_*/*"))


def test_local_every_seconds_snapshots_by_rank_0s_clock(tmp_path):
    """Snapshots at least ``local_every_seconds`` apart (measured at the calls), not at every step."""
    import time

    run = _run()
    called = {}
    with _manager(tmp_path, local_every_n_steps=None, local_every_seconds=0.3) as m:
        for step in range(1, 21):
            _train_step(run.model, run.opt, run.sched)
            called[step] = time.monotonic()
            m.maybe_save(step, run.state)
            time.sleep(0.05)
        steps = m._local.steps
    assert 2 <= len(steps) < 20, steps
    assert all(called[b] - called[a] >= 0.3 for a, b in zip(steps, steps[1:])), steps


def test_local_interval_auto_learns_the_stall_and_never_goes_below_the_write_time(tmp_path):
    run = _run()
    with _manager(tmp_path, local_every_n_steps=None, local_interval="auto", device_mtbf_hours=1e-6) as m:
        for step in range(1, 40):
            _train_step(run.model, run.opt, run.sched)
            m.maybe_save(step, run.state)
        sched = m._local.schedule
        assert len(m._local.steps) >= 3 and sched.cost_s is not None and sched.write_s is not None
        assert sched.interval_s >= sched.write_s


def test_a_truncated_slot_file_falls_back_instead_of_crashing(tmp_path, caplog):
    """The slot is mapped, not read: a file shorter than its record must be refused before it is touched (a
    mapping past the end of a file kills the process with SIGBUS)."""
    run = _run()
    m = _manager(tmp_path)
    _train(run, m, 0, 6)
    _crash(m)
    (rec,) = (tmp_path / "local").glob("job-*/rank_0/step_6.json")
    slot = rec.parent / f"slot_{json.loads(rec.read_text())['slot']}.data"
    os.truncate(slot, 100)
    with caplog.at_level(logging.WARNING, logger="ckpt_core"), _manager(tmp_path) as m2:
        assert m2.resume(_run(seed=5).state).step == 5
    assert "holds 100 bytes; its record says" in caplog.text


def test_on_in_flight_skip_skips_a_snapshot_while_the_previous_is_in_the_background(tmp_path, caplog, monkeypatch):
    """With ``on_in_flight="skip"`` the training thread never waits for the previous snapshot's seal and
    replication: the due step is skipped (and said), the next due step after it finished is taken."""
    import threading

    release = threading.Event()
    real_seal = snap.seal

    def slow_seal(*args, **kwargs):
        assert release.wait(30)
        return real_seal(*args, **kwargs)

    monkeypatch.setattr(snap, "seal", slow_seal)
    run = _run()
    with caplog.at_level(logging.INFO, logger="ckpt_core"), _manager(tmp_path, on_in_flight="skip") as m:
        m.resume(run.state)
        _train(run, m, 0, 4)  # step 2's seal is held: step 4 is skipped
        release.set()
        m._local.wait()
        _train(run, m, 4, 6)
        assert (m._local.steps, m._local.skipped) == ([2, 6], [4])
    assert "local snapshot of step 4 skipped: the snapshot of step 2 is still being sealed" in caplog.text


def test_on_in_flight_wait_waits_for_the_previous_snapshot(tmp_path, monkeypatch):
    import threading

    calls = []
    real_seal = snap.seal
    monkeypatch.setattr(snap, "seal", lambda *a, **k: (calls.append(threading.current_thread().name),
                                                         real_seal(*a, **k))[1])
    run = _run()
    with _manager(tmp_path) as m:
        m.resume(run.state)
        _train(run, m, 0, 6)
        assert (m._local.steps, m._local.skipped) == ([2, 4, 6], [])
    assert len(calls) == 3 and all(name.startswith("ckpt-local") for name in calls)


def _skip_worker(rank: int, world: int, port: int, base: str) -> None:
    """One of 4 ranks (2 nodes of 2): rank 3's seal of step 2 is held until its step 5, so at step 4 only rank 3
    is still busy; every rank must skip step 4 alike (a rank that went on would wait in a lone replication
    round), then all snapshot step 6."""
    import threading

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    release = threading.Event()
    if rank == 3:
        real_seal = snap.seal
        snap.seal = lambda *a, **k: (release.wait(20), real_seal(*a, **k))[1]
    run = _run()
    m = CheckpointManager(os.path.join(base, "root"), every_n_steps=1000, local_every_n_steps=2,
                          local_dir=os.path.join(base, f"node{rank // 2}"), local_node_size=2, run_id="skip-4",
                          on_in_flight="skip", async_mode="off", env={}, argv=[], lease=False)
    m.resume(run.state)
    for step in range(1, 7):
        if step == 5:
            release.set()
            m._local.wait()  # every rank's step-2 round is over before step 6 is due
        _train_step(run.model, run.opt, run.sched)
        m.maybe_save(step, run.state)
    m._local.wait()
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": m._local.steps, "skipped": m._local.skipped}, f)
    m.close()
    dist.destroy_process_group()


def test_on_in_flight_skip_is_agreed_by_every_rank_at_4_ranks(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_skip_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert got == [{"steps": [2, 6], "skipped": [4]}] * 4
    for node in (0, 1):  # step 6 committed on both nodes for every rank (own + replica), step 4 nowhere
        held = sorted(p.parent.name for p in (tmp_path / f"node{node}").glob("job-*/rank_*/step_6.json"))
        assert held == ["rank_0", "rank_1", "rank_2", "rank_3"]
        assert not list((tmp_path / f"node{node}").glob("job-*/rank_*/step_4.json"))


def _sharded_run(seed: int = 0) -> Run:
    """An FSDP2 model whose layers (7 and 3 output rows) shard unevenly along dim 0: torch.chunk gives the last
    rank fewer rows than the others (2, 2, 2, 1 and 1, 1, 1, 0 at 4 ranks; 4, 3 and 2, 1 at 2 ranks)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    return Run(model, opt, sched, TrainState(model, opt, sched))


def _local_shards(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}


def _uneven_budget_worker(rank: int, world: int, port: int, base: str, budget: str, local: bool) -> None:
    """One rank of ``world`` (nodes of 2) saving step 3 with ``async_mode="thread"``. ``budget="over"``: a
    max_host_memory_bytes that the largest shards' staging copy exceeds and the last rank's does not (nor any
    rank's slots alone); ``"fits"``: twice the largest need. Records how the save went, then resumes step 3."""
    import datetime

    import torch.distributed as dist

    from ckpt_core.saver import state_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("ckpt_core").addHandler(handler)
    run = _sharded_run()
    _train_step(run.model, run.opt, run.sched)  # step 1, before measuring: AdamW's state exists
    slots = layout.host_bytes_per_rank(_snapshot_nbytes(run), 1, layout.default_factor(world, 2)) if local else 0
    sizes: list = [None] * world
    dist.all_gather_object(sizes, (state_bytes(run.state) + slots, slots))
    needs, top = [need for need, _ in sizes], max(need for need, _ in sizes)
    lower = max([s for _, s in sizes] + [need for need in needs if need < top])
    limit = (lower + top) // 2 if budget == "over" else 2 * top
    tier = dict(local_every_n_steps=2, local_dir=os.path.join(base, f"node{rank // 2}"), local_node_size=2) \
        if local else {}
    opts = dict(every_n_steps=3, run_id="uneven", async_mode="thread", max_host_memory_bytes=limit,
                env={}, argv=[], lease=False, **tier)
    m = CheckpointManager(os.path.join(base, "root"), **opts)
    m.resume(run.state)
    m.maybe_save(1, run.state)
    for step in (2, 3):
        _train_step(run.model, run.opt, run.sched)
        assert m.maybe_save(step, run.state) == (step == 3)
    got = {"limit": limit, "synchronous": m._saver.inflight is None,  # step 3 durable when maybe_save returned
           "staged": len(m._saver.stager._state_dict_stager._cached_storage_mapping),
           "nbytes": state_bytes(run.state), "reserved": m._saver.reserved_host_bytes(state_bytes(run.state)),
           "warnings": [msg for msg in logged if "max_host_memory_bytes" in msg]}
    m.close()
    saved = _local_shards(run.model)
    again = _sharded_run(seed=1)
    with CheckpointManager(os.path.join(base, "root"), **opts) as m2:
        got["resumed"] = m2.resume(again.state).step
    assert_same_tree(saved, _local_shards(again.model))
    with open(os.path.join(base, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


def _spawn_uneven(tmp_path, world: int, budget: str, local: bool) -> list[dict]:
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_uneven_budget_worker, args=(world, free_port(), str(tmp_path), budget, local), nprocs=world,
             join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world,local", [(2, False), (4, True)], ids=["2-ranks", "4-ranks-local-tier"])
def test_a_staging_copy_over_the_budget_on_some_ranks_makes_every_rank_save_synchronously(tmp_path, world, local):
    """FSDP2's uneven shards: the larger ranks' staging copy exceeds max_host_memory_bytes, the last rank's does
    not. Every rank saves synchronously and says why; a rank left asynchronous would run the save's collectives
    in the background while the others run theirs on the training thread."""
    got = _spawn_uneven(tmp_path, world, "over", local)
    limit = got[0]["limit"]
    assert [g["nbytes"] + g["reserved"] > limit for g in got] == [True] * (world - 1) + [False]  # the premise
    assert all(g["reserved"] > 0 for g in got) if local else all(g["reserved"] == 0 for g in got)
    assert [(g["synchronous"], g["staged"]) for g in got] == [(True, 0)] * world
    for g in got:
        assert len(g["warnings"]) == 1 and g["warnings"][0].startswith("ckpt_core: a staging copy of")
        assert ("with the local tier's" in g["warnings"][0]) == local
        assert f"exceeds max_host_memory_bytes={limit}" in g["warnings"][0]
    assert [g["resumed"] for g in got] == [3] * world


def test_a_budget_every_rank_fits_in_keeps_uneven_shards_asynchronous(tmp_path):
    got = _spawn_uneven(tmp_path, 2, "fits", False)
    assert [(g["synchronous"], g["warnings"]) for g in got] == [(False, [])] * 2
    assert all(g["staged"] > 0 for g in got)
    assert [g["resumed"] for g in got] == [3] * 2
