"""The local tier through the adapters: ``examples/lightning_train.py`` and ``examples/accelerate_train.py`` as real
processes, SIGKILLed and relaunched with the same job id (``CKPT_RUN_ID``).

Each run saves durable checkpoints every 10 steps and local snapshots every 2 (``--local-every 2``, in a local_dir
under the test's tmp_path), and dies by SIGKILL at step 17 once step 16's snapshot is committed
(``--commit-before-kill``). The relaunch must resume from the local tier at step 16, not from the durable tier's
step 10 (so both tests fail with the local tier off), and continue exactly as an uninterrupted run without the local
tier: the losses after step 16, the final weights and the optimizer state, bit for bit. The clean end removes the
job's snapshots from local_dir.

Lightning runs on one device; Accelerate at 2 processes under torchrun (``Accelerator(cpu=True)``, gloo), compared
with the uninterrupted 2-process run of ``tests/test_accelerate_multiproc.py``'s ``reference`` fixture (same steps,
data and model: checkpointing never changes the numbers).
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from helpers_ckpt import assert_same_tree  # noqa: E402
from test_accelerate_multiproc import BATCH, SAMPLES, launch, records, start_of, steps_of  # noqa: E402
# the fixture that makes the uninterrupted runs of examples/accelerate_train.py
from test_accelerate_multiproc import reference  # noqa: E402,F401
from test_lightning_resume import Run, assert_same_weights  # noqa: E402

from ckpt_core import list_records  # noqa: E402

DURABLE_EVERY, LOCAL_EVERY, KILL_AT, SNAPSHOT = 10, 2, 17, 16
RESUMED_LINE = f"ckpt_core: resumed from the local tier at step {SNAPSHOT} (durable tier's newest: step 10)"


def job_files(local_dir: Path) -> list[Path]:
    """What the local tier holds for any job under ``local_dir`` (snapshot data, records)."""
    return sorted(local_dir.glob("job-*/rank_*/*"))


def test_lightning_resumes_bit_exact_from_the_local_tier(tmp_path, monkeypatch):
    # the job id that survives the restart (both launches, and the uninterrupted run, which has no local tier)
    monkeypatch.setenv("CKPT_RUN_ID", "lightning-local-tier")
    local, ck = tmp_path / "local", tmp_path / "ck"
    common = ["--max-steps", "24", "--every-n-steps", str(DURABLE_EVERY), "--async-mode", "thread"]
    run = ["--dirpath", str(ck), *common, "--local-every", str(LOCAL_EVERY), "--local-dir", str(local)]
    # uninterrupted, without the local tier; it runs while the killed run does (80 samples / 8: 10 steps an epoch)
    base = Run(tmp_path / "base", "--dirpath", str(tmp_path / "base_ck"), *common)
    killed = Run(tmp_path / "killed", *run, "--kill-at-step", str(KILL_AT), "--commit-before-kill")
    killed.finish(expect_rc=-signal.SIGKILL)
    assert [r.step for r in list_records(str(ck)) if r.committed] == [10]  # the durable tier is older
    assert list(local.glob(f"job-*/rank_0/step_{SNAPSHOT}.json")), "no local snapshot of step 16 was committed"

    resumed = Run(tmp_path / "resumed", *run, "--log-level", "INFO").finish()
    base.finish()
    assert resumed.summary["resumed_from"] == SNAPSHOT  # the durable tier alone would give 10
    assert RESUMED_LINE in resumed.text, resumed.text[-4000:]
    assert {k: v for k, v in resumed.summary.items() if k != "resumed_from"} == \
        {k: v for k, v in base.summary.items() if k != "resumed_from"}  # global step 24, epoch
    ref = base.losses
    assert all(killed.losses[s] == ref[s] for s in range(1, SNAPSHOT + 1))
    assert sorted(resumed.losses) == list(range(SNAPSHOT + 1, 25))
    diverged = [s for s, v in resumed.losses.items() if v != ref[s]]
    assert not diverged, f"losses differ from the uninterrupted run at steps {diverged}"
    assert_same_weights(base.weights(), resumed.weights())
    assert_same_tree(base.weights("optim"), resumed.weights("optim"))  # moments, step counts, LR schedule
    assert "resume check" not in resumed.text  # the core's own first-losses comparison agreed too
    assert job_files(local) == []  # the clean end (on_train_end ran) removed the job's snapshots


def test_accelerate_two_processes_resume_bit_exact_from_the_local_tier(tmp_path, reference):  # noqa: F811
    env = {"CKPT_RUN_ID": "accelerate-local-tier"}  # launch() drops every other CKPT_ variable
    local, ck = tmp_path / "local", tmp_path / "ck"
    common = ["--dirpath", str(ck), "--steps", "24", "--every-n-steps", str(DURABLE_EVERY), "--samples",
              str(SAMPLES), "--batch-size", str(BATCH), "--local-every", str(LOCAL_EVERY), "--local-dir", str(local),
              "--ckpt.async_mode", "thread"]
    with ThreadPoolExecutor(1) as pool:
        # uninterrupted, 2 processes, 24 steps (12 an epoch), no local tier; made while the killed run runs
        ref_made = pool.submit(reference, 2)
        launch(2, [*common, "--out", str(tmp_path / "killed"), "--kill-at-step", str(KILL_AT),
                   "--commit-before-kill"], killed=True, env=env)
        ref_out = ref_made.result()
    assert [r.step for r in list_records(str(ck)) if r.committed] == [10]  # the durable tier is older
    assert sorted(p.parent.name for p in local.glob(f"job-*/rank_*/step_{SNAPSHOT}.json")) == ["rank_0", "rank_1"], \
        "no local snapshot of step 16 was committed on every rank"

    proc = launch(2, [*common, "--out", str(tmp_path / "resumed"), "--log-level", "INFO"], env=env)
    assert RESUMED_LINE in proc.stderr, proc.stderr[-4000:]

    ref, killed, resumed = records(ref_out), records(tmp_path / "killed"), records(tmp_path / "resumed")
    assert sorted(resumed) == [0, 1]
    for rank in range(2):
        assert start_of(resumed[rank])["resumed_from"] == SNAPSHOT  # the durable tier alone would give 10
        ref_steps, killed_steps, resumed_steps = steps_of(ref[rank]), steps_of(killed[rank]), steps_of(resumed[rank])
        assert all(killed_steps[s] == ref_steps[s] for s in range(1, SNAPSHOT + 1))
        assert sorted(resumed_steps) == list(range(SNAPSHOT + 1, 25))
        for s, e in resumed_steps.items():  # exact floats, the same samples, the same epoch
            assert (e["loss"], e["indices"], e["epoch"]) == (
                ref_steps[s]["loss"], ref_steps[s]["indices"], ref_steps[s]["epoch"]), f"rank {rank} step {s}"
        w_ref = torch.load(ref_out / f"final_rank{rank}.pt", weights_only=True)
        w = torch.load(tmp_path / "resumed" / f"final_rank{rank}.pt", weights_only=True)
        assert w.keys() == w_ref.keys() and all(torch.equal(w[k], w_ref[k]) for k in w)
        assert_same_tree(torch.load(ref_out / f"final_optim_rank{rank}.pt", weights_only=True),
                         torch.load(tmp_path / "resumed" / f"final_optim_rank{rank}.pt", weights_only=True))
    assert job_files(local) == []  # the clean end removed the job's snapshots of both ranks
