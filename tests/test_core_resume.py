"""Bit-exact resume through the core API, with real processes killed by SIGKILL."""

from __future__ import annotations

import shutil
import signal

import pytest
import torch

from conftest import EXAMPLES, load_result, read_traces, run_script

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


def _kill_and_resume(tmp_path, reference, nproc: int, mode: str, extra: tuple = (), steps: int = 40,
                     every: int = 10, kill_at: int = 27) -> None:
    """Uninterrupted vs SIGKILLed-then-resumed: identical losses, samples, parameters and optimizer state.

    The uninterrupted run is ``reference``'s (saving synchronously, made once for every mode): the killed run's
    losses up to the kill and the resumed run's after it are compared with it."""
    common = ["--steps", str(steps), "--every", str(every), *extra]
    ref_prefix = reference(nproc, *common)
    common += ["--async-mode", mode]
    killed = run_script(SCRIPT, ["--root", str(tmp_path / "b"), "--kill-at-step", str(kill_at),
                                 "--trace", str(tmp_path / "trace"), *common], nproc=nproc, check=False)
    assert killed.returncode != 0  # the run really died (SIGKILL)
    if nproc == 1:
        assert killed.returncode == -signal.SIGKILL
    run_script(SCRIPT, ["--root", str(tmp_path / "b"), "--out", str(tmp_path / "b"), *common], nproc=nproc)
    newest = kill_at - kill_at % every
    traces = read_traces(tmp_path / "trace")
    assert sorted(traces) == [(0, rank, nproc) for rank in range(nproc)]
    for rank in range(nproc):
        ref_meta, ref_state = load_result(ref_prefix, rank)
        meta, state = load_result(tmp_path / "b", rank)
        # the killed run, in its own mode, trained exactly as the uninterrupted one up to the kill
        before = traces[(0, rank, nproc)]
        resumed = meta["resumed_from"]
        # (at several ranks, the first rank to die can take another down a step before the kill)
        assert [t["step"] for t in before] == list(range(1, len(before) + 1))
        assert len(before) == kill_at if nproc == 1 else resumed <= len(before) <= kill_at
        assert all(t["loss"] == ref_meta["losses"][str(t["step"])] for t in before)
        # the newest committed checkpoint before the kill (or the one before, when it was still writing)
        assert resumed in (newest - every, newest) if mode != "off" else resumed == newest
        resumed_steps = sorted(int(s) for s in meta["losses"])
        assert resumed_steps == list(range(resumed + 1, steps + 1))
        for s in resumed_steps:
            assert meta["losses"][str(s)] == ref_meta["losses"][str(s)], f"step {s}"
        # the samples seen after the resume are exactly the uninterrupted run's
        assert meta["seen"] == ref_meta["seen"][resumed:]
        assert meta["resume_check_failures"] == []
        _assert_same_state(ref_state, state)


@pytest.mark.parametrize(
    "nproc,mode",
    [(1, "off"), (1, "thread"), (1, "process"), (1, "bytes"), (2, "off"), (2, "process"), (2, "bytes")],
)
def test_kill_and_resume_is_bit_exact(tmp_path, core_reference, nproc, mode):
    _kill_and_resume(tmp_path, core_reference, nproc, mode)


def _resume_from_reference(tmp_path, reference, nproc: int, extra: tuple, steps: int, every: int,
                           resume_at: int) -> None:
    """The uninterrupted run's own checkpoint at ``resume_at``, resumed: it ends exactly as the run did."""
    common = ["--steps", str(steps), "--every", str(every), *extra]
    ref_prefix = reference(nproc, *common)
    shutil.copytree(ref_prefix, tmp_path / "b", ignore=lambda d, names: [
        n for n in names if n.startswith("step_") and int(n[5:]) > resume_at])
    run_script(SCRIPT, ["--root", str(tmp_path / "b"), "--out", str(tmp_path / "b"), *common,
                        "--async-mode", "off"], nproc=nproc)
    for rank in range(nproc):
        ref_meta, ref_state = load_result(ref_prefix, rank)
        meta, state = load_result(tmp_path / "b", rank)
        assert meta["resumed_from"] == resume_at
        assert {s: v for s, v in ref_meta["losses"].items() if int(s) > resume_at} == meta["losses"]
        assert meta["seen"] == ref_meta["seen"][resume_at:]
        _assert_same_state(ref_state, state)


def test_kill_and_resume_is_bit_exact_at_4_ranks(tmp_path, core_reference):
    """At 4 ranks the order in which gradients are summed matters (at 2 it does not): a resumed DDP must
    reduce with the buckets the original run had at that step, or the weights drift by an ulp. Saved in the
    default bytes mode."""
    _kill_and_resume(tmp_path, core_reference, 4, "bytes", ("--width", "128"), steps=16, every=4, kill_at=11)


def test_fsdp2_resume_is_bit_exact_at_4_ranks(tmp_path, core_reference):
    _resume_from_reference(tmp_path, core_reference, 4, ("--width", "128", "--fsdp"), steps=12, every=4,
                           resume_at=8)


@pytest.mark.slow
def test_resume_is_bit_exact_at_8_ranks(tmp_path, core_reference):
    _resume_from_reference(tmp_path, core_reference, 8, ("--width", "128"), steps=10, every=4, resume_at=8)


def test_ddp_bucket_layout_is_fixed_before_the_first_step(tmp_path):
    """fix_bucket_layout primes a fresh DDP once: its buckets come out in reverse parameter order (the order a
    plain run reaches after its first step), and parameters, gradients and the RNG are left as they were."""
    import json

    from conftest import WORKERS

    run_script(WORKERS / "ddp_layout_worker.py", [str(tmp_path / "facts")], nproc=2, torchrun=True)
    for rank in range(2):
        facts = json.loads((tmp_path / f"facts.rank{rank}.json").read_text())
        assert facts["primed"] == 1 and facts["primed_again"] == 0
        assert facts["params_unchanged"] and facts["grads_kept"] and facts["rng_unchanged"]
        assert facts["primed_order"] == facts["natural_order"]
        assert facts["primed_order"].split(", ")[0].startswith("7 6")
        assert facts["after_a_step"] == 0 and facts["find_unused"] == 0
