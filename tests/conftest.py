"""Shared fixtures: run scripts as real processes (python or torchrun) with time limits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests check what is decided, not how fast: no per-example deadline on a shared, noisy 2-core machine.
settings.register_profile("shared-machine", deadline=None)
settings.load_profile("shared-machine")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: Path, args: list[str], nproc: int = 1, timeout: float = 240, env: dict | None = None,
               check: bool = True, expect_rc: int | None = None, torchrun: bool = False,
               new_session: bool = False, torchrun_args: tuple = ()) -> subprocess.CompletedProcess:
    """Run ``script`` as one process, or under torchrun with ``nproc`` ranks (gloo, loopback)."""
    if nproc == 1 and not torchrun:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *torchrun_args, str(script), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO,
                          start_new_session=new_session)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    elif check:
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun starts each worker in a session of its own)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def load_result(prefix: Path | str, rank: int = 0) -> tuple[dict, dict]:
    with open(f"{prefix}.rank{rank}.json") as f:
        meta = json.load(f)
    return meta, torch.load(f"{prefix}.rank{rank}.pt", weights_only=True)


@pytest.fixture
def tmp_root(tmp_path: Path) -> Path:
    return tmp_path


def read_traces(trace_dir: Path) -> dict[tuple[int, int, int], list[dict]]:
    """Per (attempt, rank, world) the JSON lines ``examples/core_train.py --trace`` wrote."""
    out = {}
    for f in sorted(Path(trace_dir).glob("trace.attempt*.rank*.world*.jsonl")):
        a, r, w = (int(x) for x in f.stem.replace("trace.attempt", "").replace("rank", "").replace("world", "").split("."))
        out[(a, r, w)] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


@pytest.fixture(scope="session")
def core_reference(tmp_path_factory):
    """``reference(nproc, *args)``: the prefix of an uninterrupted ``examples/core_train.py --async-mode off`` run
    with those arguments, its checkpoints under the same path; each distinct run is made once per session and
    shared by every test that compares with it (checkpointing never changes the numbers, so the runs it is
    compared with may write in any mode)."""
    made: dict[tuple, Path] = {}

    def reference(nproc: int, *args: str) -> Path:
        key = (nproc, *args)
        if key not in made:
            d = tmp_path_factory.mktemp(f"core_reference_{nproc}")
            run_script(EXAMPLES / "core_train.py", ["--root", str(d / "a"), "--out", str(d / "a"), *args,
                                                    "--async-mode", "off"], nproc=nproc)
            made[key] = d / "a"
        return made[key]

    return reference
