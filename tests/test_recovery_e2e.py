"""Fault recovery end to end with torchrun: elastic restarts, world-size changes, preemption."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES, REPO, free_port, load_result, read_traces, run_script

SCRIPT = EXAMPLES / "core_train.py"


def _same_params(a: dict, b: dict) -> bool:
    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.fixture(scope="module")
def reference(core_reference):
    """The uninterrupted 2-rank run everything is compared with (the one test_core_resume.py compares with)."""
    return core_reference(2, "--steps", "40", "--every", "10")


@pytest.mark.parametrize("kill_at", [random.Random(os.getpid()).choice([24, 26, 29, 33]), 21])
def test_elastic_restart_after_sigkill_finishes_identical(tmp_path, reference, kill_at):
    """torchrun --max-restarts: rank 1 is SIGKILLed (at 21: while step 20 is being written in the
    background); the agent restarts the workers, which resume by themselves and end bit-identical."""
    out = tmp_path / "run"
    proc = run_script(SCRIPT, ["--root", str(tmp_path / "ckpt"), "--out", str(out), "--steps", "40",
                               "--async-mode", "process", "--kill-at-step", str(kill_at), "--kill-rank", "1",
                               "--trace", str(tmp_path / "trace")],
                      nproc=2, torchrun_args=("--max-restarts", "3"))
    traces = read_traces(tmp_path / "trace")
    assert max(traces[(0, 1, 2)], key=lambda t: t["step"])["step"] == kill_at  # rank 1 really died there
    assert (1, 0, 2) in traces  # and the agent restarted the workers
    for rank in (0, 1):
        ref_meta, ref_state = load_result(reference, rank)
        meta, state = load_result(out, rank)
        assert meta["resumed_from"] is not None and meta["resumed_from"] <= kill_at
        for s, loss in meta["losses"].items():
            assert loss == ref_meta["losses"][s], f"step {s}"
        assert _same_params(ref_state, state)
    assert "finished step 40" in proc.stdout


def _epoch_samples_once(traces: dict, resumed_from: int) -> None:
    """The samples of the interrupted epoch, before the checkpoint and after the resume, are the dataset once."""
    before = [t for (a, _, _), ts in traces.items() if a == 0 for t in ts if t["step"] <= resumed_from]
    after = [t for (a, _, _), ts in traces.items() if a > 0 or ts and ts[0]["resumed_from"] == resumed_from
             for t in ts if t["step"] > resumed_from and t["resumed_from"] == resumed_from]
    epoch = max(t["epoch"] for t in before if t["step"] == resumed_from)
    seen = [i for t in before if t["epoch"] == epoch for i in t["idx"]]
    seen += [i for t in after if t["epoch"] == epoch for i in t["idx"]]
    assert sorted(seen) == list(range(96)), (len(seen), len(set(seen)))


def test_world_size_4_to_2_continues_the_global_data_order(tmp_path):
    trace = tmp_path / "trace"
    root = str(tmp_path / "ckpt")
    common = ["--root", root, "--steps", "30", "--every", "4", "--async-mode", "off", "--trace", str(trace)]
    run_script(SCRIPT, [*common, "--kill-at-step", "10"], nproc=4, check=False)
    env = {"TORCHELASTIC_RESTART_COUNT": "1"}  # label the new launch's trace files as a later attempt
    proc = run_script(SCRIPT, common, nproc=2, env=env)
    assert "finished step 30 (resumed from step 8)" in proc.stdout
    traces = read_traces(trace)
    assert {k[2] for k in traces} == {4, 2}
    _epoch_samples_once(traces, 8)


def test_two_agents_shrink_to_one_and_continue(tmp_path):
    """Two torchrun agents form one job (c10d on loopback); one agent is killed; the survivor's
    workers restart at world size 1, reshard the checkpoint and finish the epoch without repeats."""
    port, trace, root = free_port(), tmp_path / "trace", str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def agent(hosts_store: bool) -> list[str]:
        # The store's host is named, never raced for: the node that is killed must not be the one
        # holding the rendezvous store (a real cluster's endpoint is a node that stays).
        conf = f"last_call_timeout=8,join_timeout=90,close_timeout=10,is_host={int(hosts_store)}"
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink",
                "--rdzv-conf", conf, "--max-restarts", "3",
                "--monitor-interval", "0.5", str(SCRIPT), "--root", root, "--steps", "36", "--every", "3",
                "--async-mode", "off", "--step-sleep", "0.25", "--trace", str(trace)]

    log_a = open(tmp_path / "agent_a.log", "w+")
    a = subprocess.Popen(agent(True), env=env, stdout=log_a, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    time.sleep(1)
    log_b = open(tmp_path / "agent_b.log", "w+")
    b = subprocess.Popen(agent(False), env=env, stdout=log_b, stderr=subprocess.STDOUT, cwd=REPO,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            steps = [json.loads(x)["step"] for f in trace.glob("*world2.jsonl") for x in f.read_text().splitlines()]
            if steps and max(steps) >= 8:
                break
            time.sleep(0.2)
        else:
            log_a.seek(0)
            log_b.seek(0)
            pytest.fail("the 2-node job never reached step 8:\n" + log_a.read()[-3000:] + "\n----\n" + log_b.read()[-3000:])
        import psutil

        node_b = [*psutil.Process(b.pid).children(recursive=True), psutil.Process(b.pid)]
        for proc in node_b:  # the whole second node goes away: its workers and its agent
            proc.kill()
        a.wait(timeout=240)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    log_a.seek(0)
    assert a.returncode == 0, log_a.read()[-4000:]
    traces = read_traces(trace)
    survivors = [k for k in traces if k[2] == 1]
    assert survivors, f"no world-size-1 attempt: {sorted(traces)}"
    resumed_from = traces[survivors[0]][0]["resumed_from"]
    assert resumed_from is not None and resumed_from % 3 == 0
    assert traces[survivors[-1]][-1]["step"] == 36
    _epoch_samples_once(traces, resumed_from)


def test_sigterm_to_one_rank_saves_everywhere_and_resumes_with_zero_lost_steps(tmp_path, reference):
    root, trace = str(tmp_path / "ckpt"), tmp_path / "trace"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), "--root", root, "--steps", "40",
           "--async-mode", "process", "--step-sleep", "0.1", "--trace", str(trace)]
    log = open(tmp_path / "run.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    pid = None
    while time.monotonic() < deadline and pid is None:
        lines = [json.loads(x) for f in trace.glob("*rank1*.jsonl") for x in f.read_text().splitlines()]
        if lines and lines[-1]["step"] >= 13:
            pid = lines[-1].get("pid")
        time.sleep(0.1)
    assert pid, "rank 1 never reached step 13"
    os.kill(pid, signal.SIGTERM)  # as a cluster scheduler would, to one rank only
    proc.wait(timeout=120)
    log.seek(0)
    err = log.read()
    assert "exitcode  : 143" in err, err[-3000:]
    traces = read_traces(trace)
    last = {r: max(t["step"] for t in traces[(0, r, 2)]) for r in (0, 1)}
    assert last[0] == last[1]  # both ranks stopped at the same step boundary
    stopped = last[0]
    assert stopped % 10 != 0 or stopped >= 13
    from ckpt_core.discovery import list_records

    committed = [r.step for r in list_records(root) if r.committed]
    assert committed[-1] == stopped  # the preemption checkpoint is the very last step: nothing lost
    out_prefix = tmp_path / "resumed"
    run_script(SCRIPT, ["--root", root, "--steps", "40", "--async-mode", "process", "--out", str(out_prefix)], nproc=2)
    for rank in (0, 1):
        ref_meta, ref_state = load_result(reference, rank)
        meta, state = load_result(out_prefix, rank)
        assert meta["resumed_from"] == stopped
        assert sorted(int(s) for s in meta["losses"]) == list(range(stopped + 1, 41))
        assert all(meta["losses"][s] == ref_meta["losses"][s] for s in meta["losses"])
        assert _same_params(ref_state, state)
