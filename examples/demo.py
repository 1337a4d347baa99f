"""The main job: train, crash, resume, and check that the resumed run is the run that would have been.

1. train 40 steps uninterrupted (2 ranks, DDP over gloo, async checkpoints every 10 steps);
2. train again into a fresh directory and SIGKILL every rank right after step 27;
3. launch again: it resumes by itself from the newest valid checkpoint;
4. compare per-step losses and final parameters with run 1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RUN = Path(os.environ.get("DEMO_DIR", "demo_run")).resolve()


def launch(root: Path, *extra: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(HERE / "core_train.py"), "--root", str(root), "--steps", "40",
           "--every", "10", "--async-mode", "bytes", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).returncode


def main() -> None:
    shutil.rmtree(RUN, ignore_errors=True)
    RUN.mkdir(parents=True)
    print("1/3 training 40 steps without interruption (2 ranks, async checkpoints every 10 steps)...")
    assert launch(RUN / "reference", "--out", str(RUN / "reference")) == 0
    print("2/3 training again; every rank is killed with SIGKILL right after step 27...")
    rc = launch(RUN / "crashed", "--kill-at-step", "27")
    print(f"    the run died (exit code {rc})")
    print("3/3 launching again: resuming from the newest valid checkpoint...")
    assert launch(RUN / "crashed", "--out", str(RUN / "resumed")) == 0
    ok = True
    for rank in range(2):
        ref = json.load(open(f"{RUN / 'reference'}.rank{rank}.json"))
        got = json.load(open(f"{RUN / 'resumed'}.rank{rank}.json"))
        steps = sorted(int(s) for s in got["losses"])
        same_losses = all(got["losses"][str(s)] == ref["losses"][str(s)] for s in steps)
        a = torch.load(f"{RUN / 'reference'}.rank{rank}.pt", weights_only=True)
        b = torch.load(f"{RUN / 'resumed'}.rank{rank}.pt", weights_only=True)
        same_params = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        ok &= same_losses and same_params
        print(f"    rank {rank}: resumed from step {got['resumed_from']}, steps {steps[0]}..{steps[-1]}: "
              f"losses {'identical' if same_losses else 'DIFFERENT'}, final parameters "
              f"{'identical' if same_params else 'DIFFERENT'}")
    print(f"checkpoints are in {RUN / 'crashed'}; try: ckpt ls {RUN / 'crashed'}")
    if ok:
        print("resumed run matched the uninterrupted run exactly")
    else:
        print("resumed run did NOT match")
        sys.exit(1)


if __name__ == "__main__":
    main()
