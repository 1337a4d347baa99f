"""Worker: examples/accelerate_train.py run in-process; then how its process group ends (facts as JSON per rank).

The script ends as Accelerate's examples do: ``end_training()`` destroys the process group while the prepared
DDP model is still alive; the model dies when ``main`` returns. gloo's destructor must not run then, inside DDP's
reducer with the GIL held (a worker thread that needs the GIL to release a tensor hangs the exit), but later, when
``pg_lifetime.release_orphaned`` drops the group from Python.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> None:
    out, example, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank = int(os.environ["RANK"])
    module = runpy.run_path(example, run_name="accelerate_train")
    module["main"](args)
    del module
    gc.collect()
    from ckpt_core.pg_lifetime import held_count, release_orphaned

    facts = {"threads_after_main": threads(), "held_after_main": held_count()}
    release_orphaned()
    facts.update(threads_released=threads(), held_released=held_count())
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(facts, f)


if __name__ == "__main__":
    main()
