"""Worker: ``examples/core_train.py`` whose ranks never commit the replicas of step ``STALL_REPLICAS_OF_STEP``.

The replica arrives and is checked, then its receiver stalls before committing it, as a node killed in the
middle of replication would leave it.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from pathlib import Path

import ckpt_core.local_tier as local_tier

STALL = int(os.environ["STALL_REPLICAS_OF_STEP"])


def _stall(owner: int, step: int) -> None:
    if step == STALL:
        threading.Event().wait()


if __name__ == "__main__":
    local_tier._before_replica_commit = _stall
    script = Path(__file__).resolve().parents[2] / "examples" / "core_train.py"
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
