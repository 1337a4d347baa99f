"""Local tier at 4 ranks as 2 nodes of 2: two torchrun agents on loopback, each "node" with its own local_dir.

One run snapshots every 2 steps (durable checkpoints every 10) and every rank dies by SIGKILL at step 17, after
step 16's snapshots and replicas are committed. Each test relaunches a copy of what it left, with the two nodes
swapped (torchrun does not keep ranks on their node across restarts), after losing or corrupting what the test
says, and compares with an uninterrupted run: losses, samples, weights and optimizer state, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO, free_port, load_result
from helpers_ckpt import assert_same_tree, run_cli

SCRIPT = EXAMPLES / "core_train.py"
STALLING = Path(__file__).resolve().parent / "workers" / "local_tier_worker.py"
TRAIN = ["--steps", "24", "--every", "10", "--width", "128"]
LOCAL = ["--local-every", "2", "--async-mode", "thread"]


def two_nodes(work: Path, node0_dir: Path, node1_dir: Path, args: list[str], script: Path = SCRIPT,
              env: dict | None = None, nproc: int = 2, nnodes: int = 2) -> list[str]:
    """Run the job as ``nnodes`` torchrun agents (node 0 with ``node0_dir`` as its local_dir); their logs."""
    port = free_port()
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CKPT_RUN_ID": "job-17",
            "LOGLEVEL": "INFO", **(env or {})}
    procs = []
    for node, local_dir in list(enumerate([node0_dir, node1_dir]))[:nnodes]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port), str(script),
               "--root", str(work / "root"), "--out", str(work / "out"), *args]
        log = open(work / f"agent{node}.log", "w+")
        procs.append((subprocess.Popen(cmd, env={**base, "CKPT_LOCAL_DIR": str(local_dir)}, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=REPO), log))
    logs = []
    for proc, log in procs:
        try:
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        logs.append(log.read())
    return logs


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The run SIGKILLed at step 17 (every rank), with step 16 committed on both nodes."""
    work = tmp_path_factory.mktemp("local_killed")
    logs = two_nodes(work, work / "nodeA", work / "nodeB", [*TRAIN, *LOCAL, "--kill-at-step", "17",
                                                              "--commit-before-kill"])
    assert "Signal 9 (SIGKILL)" in logs[0] + logs[1], logs[0][-3000:]
    return work


def relaunch(tmp_path: Path, killed: Path, lose=lambda work: None, **kwargs) -> tuple[Path, str]:
    """A copy of the killed run, ``lose`` applied to it, relaunched with the nodes swapped; (work dir, logs)."""
    work = tmp_path / "run"
    shutil.copytree(killed, work, ignore=shutil.ignore_patterns("out.*", "agent*.log"))
    lose(work)
    logs = two_nodes(work, work / "nodeB", work / "nodeA", [*TRAIN, *LOCAL], **kwargs)
    return work, "\n".join(logs)


def records(node_dir: Path, owner: int) -> list[Path]:
    return sorted(node_dir.glob(f"job-*/rank_{owner}/step_*.json"))


def assert_exact(work: Path, reference: Path, resumed_at: int, logs: str, world: int = 4) -> None:
    assert "finished step 24" in logs, logs[-4000:]
    for rank in range(world):
        ref_meta, ref_state = load_result(reference, rank)
        meta, state = load_result(work / "out", rank)
        assert meta["resumed_from"] == resumed_at
        assert meta["losses"] == {s: v for s, v in ref_meta["losses"].items() if int(s) > resumed_at}
        assert meta["seen"] == ref_meta["seen"][resumed_at:]
        assert_same_tree(ref_state, state)


def test_resumes_from_node_memory_with_the_nodes_swapped(tmp_path, killed, core_reference):
    work, logs = relaunch(tmp_path, killed)
    assert "resumed from the local tier at step 16 (durable tier's newest: step 10)" in logs
    assert_exact(work, core_reference(4, *TRAIN), 16, logs)
    # a clean end removes the job's snapshots from both nodes
    assert not list((work / "nodeA").glob("job-*/rank_*/*")) and not list((work / "nodeB").glob("job-*/rank_*/*"))


def test_ckpt_ls_on_each_node_says_which_copies_it_holds(capsys, killed):
    """What the killed run left, listed on each node: its own ranks' snapshots, the replicas of the other
    node's ranks, and where the other copies are."""
    from ckpt_core import local_tier
    from ckpt_core.local_listing import scan

    host = local_tier._HOST
    for node_dir, node, own, replicas, other in [("nodeA", 0, "0,1", "2,3", 1), ("nodeB", 1, "2,3", "0,1", 0)]:
        code, out, err = run_cli(capsys, "ls", str(killed / "root"), "--local-dir", str(killed / node_dir),
                                 "--run-id", "job-17")
        assert code == 0 and err == ""
        row = next(line for line in out.splitlines() if "  step 16  " in line)
        assert "  world 4  ranks 0-3  complete  " in row
        assert row.endswith(f"  node {node} ({host}): own {own}, replicas of {replicas}; other copies on node {other}")
        group = next(g for g in scan(str(killed / node_dir)).groups if g.step == 16)
        assert (sorted(group.own), sorted(group.replicas), group.elsewhere) == (
            [int(r) for r in own.split(",")], [int(r) for r in replicas.split(",")], {other})


def test_a_lost_node_is_restored_from_the_replicas_on_its_peer(tmp_path, killed, core_reference):
    work, logs = relaunch(tmp_path, killed, lambda w: shutil.rmtree(w / "nodeB"))
    assert "resumed from the local tier at step 16" in logs
    assert_exact(work, core_reference(4, *TRAIN), 16, logs)


def test_both_copies_of_one_rank_lost_or_bad_falls_back_to_the_durable_tier(tmp_path, killed, core_reference):
    def lose(work: Path) -> None:
        for rec in records(work / "nodeA", 3):  # one copy gone
            rec.unlink()
        for slot in (work / "nodeB").glob("job-*/rank_3/slot_*.data"):  # the other corrupted
            data = bytearray(slot.read_bytes())
            data[100] ^= 0xFF
            slot.write_bytes(bytes(data))

    work, logs = relaunch(tmp_path, killed, lose)
    assert "local snapshot of rank 3 at step 16 on node" in logs and "fails its checksum" in logs
    assert "resumed from the local tier" not in logs
    assert_exact(work, core_reference(4, *TRAIN), 10, logs)


def test_another_world_size_reshards_from_the_durable_tier(tmp_path, killed, core_reference):
    work, logs = relaunch(tmp_path, killed, nnodes=1)
    assert "the snapshots of this job are for world size 4, this run has 2" in logs
    assert "resharding goes through the durable tier" in logs
    for rank in range(2):
        meta, _ = load_result(work / "out", rank)
        assert meta["resumed_from"] == 10


def test_a_snapshot_killed_while_replicating_never_counts(tmp_path, core_reference):
    """Replicas of step 16 are received but never committed (the receivers stall) and the run dies at step 17;
    then node B is lost: its ranks' step 16 exists nowhere else, so every rank resumes from step 14."""
    work = tmp_path / "stall"
    work.mkdir()
    logs = two_nodes(work, work / "nodeA", work / "nodeB", [*TRAIN, *LOCAL, "--kill-at-step", "17"],
                     script=STALLING, env={"STALL_REPLICAS_OF_STEP": "16"})
    assert "Signal 9 (SIGKILL)" in "".join(logs)
    # the replica of 16 never committed (whether its slot was claimed before the kill depends on timing: 12 may stay)
    kept = [r.name for r in records(work / "nodeA", 2)]
    assert "step_14.json" in kept and "step_16.json" not in kept, kept
    shutil.rmtree(work / "nodeB")
    for f in work.glob("out.*"):
        f.unlink()
    logs = "\n".join(two_nodes(work, work / "nodeB", work / "nodeA", [*TRAIN, *LOCAL]))
    assert "resumed from the local tier at step 14" in logs
    assert_exact(work, core_reference(4, *TRAIN), 14, logs)


def test_another_job_never_reads_these_snapshots(tmp_path, killed):
    """Another job (another run id, its own durable root) on the same nodes starts from scratch; the first job's
    snapshots stay for it."""
    work, logs = relaunch(tmp_path, killed, lambda w: shutil.rmtree(w / "root"), env={"CKPT_RUN_ID": "job-18"})
    assert "resumed from the local tier" not in logs
    assert json.loads((work / "out.rank0.json").read_text())["resumed_from"] is None
    assert [r.name for r in records(work / "nodeA", 0)] == ["step_14.json", "step_16.json"]
