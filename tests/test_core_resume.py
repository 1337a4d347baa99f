"""Bit-exact resume through the core API, with real processes killed by SIGKILL."""

from __future__ import annotations

import signal

import pytest
import torch

from conftest import EXAMPLES, load_result, run_script

SCRIPT = EXAMPLES / "core_train.py"


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        for name in sa[pid]:
            assert torch.equal(sa[pid][name], sb[pid][name]), (pid, name)


@pytest.mark.parametrize(
    "nproc,mode",
    [(1, "off"), (1, "thread"), (1, "process"), (2, "off"), (2, "process")],
)
def test_kill_and_resume_is_bit_exact(tmp_path, nproc, mode):
    common = ["--steps", "40", "--every", "10", "--async-mode", mode]
    run_script(SCRIPT, ["--root", str(tmp_path / "a"), "--out", str(tmp_path / "a"), *common], nproc=nproc)
    killed = run_script(SCRIPT, ["--root", str(tmp_path / "b"), "--kill-at-step", "27", *common],
                        nproc=nproc, check=False)
    assert killed.returncode != 0  # the run really died (SIGKILL)
    if nproc == 1:
        assert killed.returncode == -signal.SIGKILL
    run_script(SCRIPT, ["--root", str(tmp_path / "b"), "--out", str(tmp_path / "b"), *common], nproc=nproc)
    for rank in range(nproc):
        ref_meta, ref_state = load_result(tmp_path / "a", rank)
        meta, state = load_result(tmp_path / "b", rank)
        resumed = meta["resumed_from"]
        # the newest committed checkpoint before the kill: 20 (or 10 when step 20 was still writing)
        assert resumed in (10, 20) if mode != "off" else resumed == 20
        resumed_steps = sorted(int(s) for s in meta["losses"])
        assert resumed_steps == list(range(resumed + 1, 41))
        for s in resumed_steps:
            assert meta["losses"][str(s)] == ref_meta["losses"][str(s)], f"step {s}"
        # the samples seen after the resume are exactly the uninterrupted run's
        assert meta["seen"] == ref_meta["seen"][resumed:]
        assert meta["resume_check_failures"] == []
        _assert_same_state(ref_state, state)
