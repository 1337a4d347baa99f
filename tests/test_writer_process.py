"""The checkpoint writer process starts without the training script.

``spawn`` runs the parent's main module in every child before its target:
the training script's top-level imports and statements would run again in
the writer (``import lightning`` alone: 67 MB), and a script without an
``if __name__ == "__main__":`` guard would start a second run there. The
writer is started without it; state that names a class of the script (which
the writer could not unpickle) is refused with the fix.
"""

from __future__ import annotations

import textwrap

from conftest import run_script

_TOP_LEVEL_RUN = '''
import os, sys
import torch
from ckpt_core import CheckpointManager, TrainState
from ckpt_core import background

with open(os.environ["MARKER"], "a") as f:  # every process that runs this script's top level
    f.write(f"{os.getpid()}\\n")
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
manager = CheckpointManager(sys.argv[1], async_mode="process", handle_preemption=False)
manager.save(3, TrainState(model=model))
manager.wait()
writer = background.PROCESS._proc._save_process.pid
fresh = torch.nn.Linear(8, 4)
info = CheckpointManager(sys.argv[1], async_mode="process", handle_preemption=False).resume(TrainState(model=fresh))
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
print(f"RESULT step={info.step} same={same} trainer={os.getpid()} writer={writer}")
'''

_SCRIPT_CLASS = '''
import sys
import torch
from ckpt_core import CheckpointManager, TrainState
from ckpt_core.errors import SaveError


class Knob:
    pass


class Tuned(torch.nn.Linear):
    def get_extra_state(self):
        return {"knob": Knob()}

    def set_extra_state(self, state):
        pass


if __name__ == "__main__":
    state = TrainState(model=Tuned(4, 2))
    manager = CheckpointManager(sys.argv[1] + "/process", async_mode="process", handle_preemption=False)
    try:
        manager.save(1, state)
        manager.wait()
        print("REFUSED none")
    except SaveError as e:
        print("REFUSED", e)
    thread = CheckpointManager(sys.argv[1] + "/thread", async_mode="thread", handle_preemption=False)
    thread.save(1, state)
    thread.wait()
    print("THREAD saved")
    remote = CheckpointManager(sys.argv[1] + "/bytes", async_mode="bytes", handle_preemption=False)
    remote.save(1, state)
    remote.wait()
    print("BYTES saved")
'''


def _result(out: str, tag: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(tag))


def test_the_writer_process_runs_no_line_of_the_training_script(tmp_path):
    script = tmp_path / "train_unguarded.py"  # no __main__ guard: its top level is the whole run
    script.write_text(textwrap.dedent(_TOP_LEVEL_RUN))
    marker = tmp_path / "marker"
    proc = run_script(script, [str(tmp_path / "ckpt")], env={"MARKER": str(marker)})
    fields = dict(kv.split("=") for kv in _result(proc.stdout, "RESULT").split()[1:])
    assert fields["step"] == "3" and fields["same"] == "True", proc.stdout
    assert fields["writer"] != fields["trainer"]  # the save went through a writer process
    assert marker.read_text().split() == [fields["trainer"]]  # and only the trainer ran the script


def test_state_naming_a_script_class_is_refused_in_process_mode_with_the_fix(tmp_path):
    script = tmp_path / "train_knob.py"
    script.write_text(textwrap.dedent(_SCRIPT_CLASS))
    proc = run_script(script, [str(tmp_path)])
    refused = _result(proc.stdout, "REFUSED")
    assert "checkpoint save at step 1 failed" in refused and "__main__.Knob" in refused, proc.stdout
    assert "async_mode='thread'" in refused and "async_mode='bytes'" in refused, refused
    assert "importable module" in refused, refused
    from ckpt_core.storage import step_dirname

    assert not (tmp_path / "process" / step_dirname(1)).exists(), proc.stdout  # nothing half-written
    assert (tmp_path / "thread" / step_dirname(1)).is_dir(), proc.stdout  # the fixes the message names work
    assert (tmp_path / "bytes" / step_dirname(1)).is_dir(), proc.stdout


def test_script_classes_names_every_class_of_the_script_in_nested_containers():
    from ckpt_core.background import script_classes

    Knob = type("Knob", (), {"__module__": "__main__"})
    Other = type("Other", (), {"__module__": "tests.elsewhere"})
    state = {"model": {"w": [1.0, (Other(), {Knob(): "key"})]}, "optim": {"groups": [{"lr": 0.1}]}}
    assert script_classes(state) == ["__main__.Knob"]
    assert script_classes({"a": [Other(), 3, "x", None]}) == []
    loop: list = [Knob()]
    loop.append(loop)  # a cycle ends the walk
    assert script_classes({"a": loop, "b": loop}) == ["__main__.Knob"]
