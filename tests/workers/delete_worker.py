"""Worker: delete checkpoints slowly through retention's own deletion path, to be SIGKILLed mid-way."""

from __future__ import annotations

import sys

from ckpt_core.storage import get_fs, join, remove_tree, step_dirname

if __name__ == "__main__":
    root, control, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    fs, path = get_fs(root, control=control)
    print("deleting", flush=True)
    for step in steps:
        remove_tree(fs, join(path, step_dirname(step)))
    print("done", flush=True)
