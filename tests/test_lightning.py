"""``lightning_ckpt.DistributedCheckpoint`` in-process: CLI, fallback, exceptions, defaults, the sampler.

The multi-process scenarios (SIGKILL, DDP, FSDP2, SIGTERM) are in
``test_lightning_resume.py``; these run ``examples/lightning_train.py``'s
``main`` or a ``Trainer`` in the test process on one CPU device.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DistributedSampler, TensorDataset  # noqa: E402

from ckpt_core import list_records  # noqa: E402
from lightning_ckpt import DistributedCheckpoint, LightningResumableSampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import lightning_train  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated():
    threads, env = torch.get_num_threads(), dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    torch.set_num_threads(threads)  # the example pins one thread
    os.environ.clear()
    os.environ.update(env)  # seed_everything sets PL_GLOBAL_SEED
    # the core's preemption handlers and Lightning's are gone after fit, also after an exception
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def losses(prefix: Path) -> dict[int, str]:
    with open(f"{prefix}.losses") as f:
        return {int(s): v for s, v in (line.split() for line in f)}


def committed(root: Path) -> list[int]:
    return [r.step for r in list_records(str(root)) if r.committed]


def trainer(root: Path, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, default_root_dir=str(root))
    return L.Trainer(**{**defaults, **kwargs})


def test_cli_flags_reach_the_callback():
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(lightning_train.Regressor, run=False, save_config_kwargs={"overwrite": True}, args=[
        "--trainer.logger=false",
        "--trainer.callbacks+=lightning_ckpt.DistributedCheckpoint",
        "--trainer.callbacks.every_n_train_steps=100",
        "--trainer.callbacks.dirpath=memory://cli-run",
        "--trainer.callbacks.keep_last=3",
        "--trainer.callbacks.train_time_interval=0:30:00",
        "--trainer.callbacks.keep_best=[val_loss, min, 2]",
        "--trainer.callbacks.settings.writer_threads=2",
    ])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, DistributedCheckpoint)]
    assert cb.every_n_train_steps == 100 and cb.dirpath == "memory://cli-run"
    settings = cb.settings
    assert settings.every_n_steps == 100 and settings.keep_last == 3 and settings.every_seconds == 1800.0
    assert settings.keep_best == ("val_loss", "min", 2) and settings.writer_threads == 2


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="keep_last"):
        DistributedCheckpoint(keep_last=0)
    with pytest.raises(ValueError, match="async_mode"):
        DistributedCheckpoint(async_mode="fork")


def test_fresh_start_is_quiet_and_a_corrupt_newest_checkpoint_falls_back(tmp_path):
    root = tmp_path / "ck"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = lightning_train.main(["--dirpath", str(root), "--max-steps", "8", "--out", str(tmp_path / "a")])
    ours = [w for w in caught if "checkpoint" in str(w.message).lower()
            or any(p in w.filename for p in ("ckpt_core", "lightning_ckpt"))]
    assert not ours, [str(w.message) for w in ours]
    assert first["resumed_from"] is None and committed(root) == [4, 8]

    shard = next((root / "step_000000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn shard in the newest
    with pytest.warns(UserWarning, match=r"step 8\).*falling back"):
        second = lightning_train.main(["--dirpath", str(root), "--max-steps", "10", "--out", str(tmp_path / "b")])
    assert second["resumed_from"] == 4 and second["global_step"] == 10
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == list(range(5, 11))
    assert all(b[s] == a[s] for s in range(5, 9))  # steps 5..8 again, bit-exact


class _Failing(lightning_train.Regressor):
    def __init__(self, where: str, at: int) -> None:
        super().__init__()
        self.where, self.at = where, at

    def training_step(self, batch, batch_idx):
        if self.where == "training_step" and self.trainer.global_step == self.at - 1:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.where == "batch_end" and self.trainer.global_step == self.at:
            raise RuntimeError("boom after the step")


@pytest.mark.parametrize("where,expected", [("batch_end", [4, 6]), ("training_step", [4])])
def test_save_on_exception_only_at_a_step_boundary(tmp_path, where, expected):
    cb = DistributedCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_on_exception=True)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, callbacks=[cb]).fit(_Failing(where, 6))
    assert committed(tmp_path / "ck") == expected
    assert cb.manager is None  # closed: flushed, handlers restored
    if where == "batch_end":  # the exception checkpoint resumes like any other
        cb2 = DistributedCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4)
        t = trainer(tmp_path, callbacks=[cb2], max_steps=7)
        t.fit(lightning_train.Regressor())
        assert cb2.resumed_from == 6 and t.global_step == 7


def test_the_checkpoint_age_is_logged_at_lightnings_logging_cadence(tmp_path):
    """``ckpt/age_s`` (and the failure counts) reach the Trainer's logger every ``log_every_n_steps``, between saves
    too, at the step Lightning logs its own metrics."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    cb = DistributedCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=5, async_mode="off")
    t = trainer(tmp_path, callbacks=[cb], max_steps=6, log_every_n_steps=2,
                logger=CSVLogger(str(tmp_path), name="logs"))
    t.fit(lightning_train.Regressor())
    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    alerts = [r for r in rows if r.get("ckpt/age_s") and not r.get("ckpt/blocking_s")]
    assert [int(r["step"]) for r in alerts] == [2, 4, 6]
    assert float(alerts[2]["ckpt/age_s"]) < float(alerts[1]["ckpt/age_s"])  # step 5's checkpoint committed between
    assert {r["ckpt/failed_saves"] for r in alerts} == {"0.0"}


def test_default_dirpath_follows_model_checkpoint(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    cb = DistributedCheckpoint(every_n_train_steps=2)
    trainer(tmp_path, callbacks=[cb], max_steps=2).fit(lightning_train.Regressor())
    assert committed(tmp_path / "checkpoints") == [2]

    cb = DistributedCheckpoint(every_n_train_steps=2)
    t = trainer(tmp_path, callbacks=[cb], max_steps=2, logger=CSVLogger(str(tmp_path), name="logs"))
    t.fit(lightning_train.Regressor())
    assert committed(tmp_path / "logs" / "version_0" / "checkpoints") == [2]
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "ckpt/blocking_s" in metrics and "ckpt/write_s" in metrics

    # A new logger version does not resume from the previous one's checkpoints: say so.
    cb = DistributedCheckpoint(every_n_train_steps=2)
    t = trainer(tmp_path, callbacks=[cb], max_steps=2, logger=CSVLogger(str(tmp_path), name="logs"))
    with pytest.warns(UserWarning, match="earlier run"):
        t.fit(lightning_train.Regressor())


def test_lightning_sampler_keeps_lightnings_epoch_length_and_distributed_order():
    data = TensorDataset(torch.arange(50.0))
    ref = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=3)) for r in range(2)]
    for r in range(2):
        s = LightningResumableSampler(data, num_replicas=2, rank=r, shuffle=True, seed=3, drop_last=False,
                                      batch_size=4)
        assert list(s) == ref[r] and len(s) == 25
        s.set_trained(3)  # three batches of 4 on each of 2 ranks
        state = s.state_dict()
        assert state["consumed"] == 24
        resumed = LightningResumableSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0, drop_last=False,
                                            batch_size=4)
        resumed.load_state_dict(state)
        resumed.base_batches = 3  # Lightning counts three batches of this epoch as done
        assert list(resumed) == ref[r][12:]
        assert math.ceil(len(resumed) / 4) == math.ceil(25 / 4)  # Lightning's epoch length is unchanged
        resumed.set_epoch(1)
        assert resumed.consumed == 0 and len(resumed) == 25

    # At another world size the rest of the epoch is dealt to the new ranks, each sample once.
    one = LightningResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=False, batch_size=4)
    one.load_state_dict(state)
    one.base_batches = 3
    seen = [i for r in range(2) for i in ref[r][:12]] + list(one)
    assert sorted(seen) == list(range(50))
    assert math.ceil(len(one) / 4) == 3 + math.ceil(26 / 4)


class _FakeDist:
    """``torch.distributed`` as ``ckpt_core.coordination`` sees it, one rank per thread."""

    def __init__(self, world: int) -> None:
        import threading

        self.world, self.local = world, threading.local()

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return self.world

    def get_rank(self) -> int:
        return self.local.rank


@pytest.mark.parametrize("arrive,ok,expected", [
    ((0, 1), (True, True), True),     # everyone there at a boundary: save
    ((0, 1), (True, False), False),   # one rank mid-step: nobody saves
    ((1,), (True, True), False),      # rank 0 stuck elsewhere: rank 1 gives up alone
    ((0,), (True, True), False),      # rank 1 stuck elsewhere: rank 0 gives up alone
])
def test_exception_agreement_without_collectives(monkeypatch, arrive, ok, expected):
    import threading

    import torch.distributed as dist

    from ckpt_core import coordination

    fake = _FakeDist(2)
    monkeypatch.setattr(coordination, "dist", fake)
    calls = threading.local()  # each "process" numbers its own calls
    monkeypatch.setattr(coordination, "_calls", type("Counter", (), {"__next__": lambda self: calls.n})())
    store, answers = dist.HashStore(), {}

    def rank(r: int) -> None:
        fake.local.rank, calls.n = r, 0
        answers[r] = coordination.all_ranks_agree("exception/7", ok[r], timeout_s=0.3, store=store)

    threads = [threading.Thread(target=rank, args=(r,)) for r in arrive]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == {r: expected for r in arrive}  # the same answer wherever it was asked


class _Evaluated(lightning_train.Regressor):
    """Records the weights each evaluation entry point ran with."""

    def on_validation_start(self) -> None:
        self.seen = {k: v.detach().clone() for k, v in self.state_dict().items()}

    on_test_start = on_predict_start = on_validation_start

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()


def test_validate_test_predict_load_our_checkpoints(tmp_path):
    """``validate/test/predict(ckpt_path=...)`` with a step directory or a root (its newest valid): the model runs
    with exactly the saved weights; the checkpoints on disk are left alone (an older step is not a rollback)."""
    root = tmp_path / "ck"
    model = lightning_train.Regressor()
    saved = {}

    class Keep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            saved[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    trainer(tmp_path, callbacks=[DistributedCheckpoint(root, every_n_train_steps=4, async_mode="off"), Keep()]).fit(model)
    assert committed(root) == [4, 8]
    before = sorted(os.listdir(root))

    def run(fn, ckpt_path):
        evaluated = _Evaluated()
        t = trainer(tmp_path, callbacks=[DistributedCheckpoint(root)], limit_val_batches=1, limit_test_batches=1,
                    limit_predict_batches=1)
        getattr(t, fn)(evaluated, ckpt_path=str(ckpt_path))
        return evaluated.seen

    for fn, path, step in [("validate", root / "step_000000004", 4), ("test", root, 8), ("predict", root, 8)]:
        seen = run(fn, path)
        assert seen.keys() == saved[step].keys()
        assert all(torch.equal(seen[k], saved[step][k]) for k in seen), (fn, step)
    assert sorted(os.listdir(root)) == before  # an explicit older step is not a rollback here


def test_slurm_requeue_comes_after_our_checkpoint_and_the_requeued_run_resumes_from_it(tmp_path, monkeypatch):
    """``SLURMEnvironment`` auto-requeue: SIGUSR1 saves our checkpoint on the next step boundary, then rank 0 runs
    ``scontrol requeue <job>`` (a fake on PATH records it), with no ``hpc_ckpt`` written; the requeued run resumes
    from our checkpoint although an ``hpc_ckpt_*.ckpt`` is present."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    for k, v in dict(SLURM_JOB_ID="4242", SLURM_NTASKS="1", SLURM_JOB_NAME="train", SLURM_PROCID="0",
                     SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost").items():
        monkeypatch.setenv(k, v)
    root, home = tmp_path / "ck", tmp_path / "home"

    class Signal(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)

    def slurm_trainer(*callbacks, max_steps=12):
        return trainer(home, max_steps=max_steps, callbacks=list(callbacks),
                       plugins=[SLURMEnvironment(requeue_signal=signal.SIGUSR1)])

    with pytest.raises(SystemExit) as stop:
        slurm_trainer(DistributedCheckpoint(root, every_n_train_steps=100), Signal()).fit(lightning_train.Regressor())
    assert stop.value.code == 143
    assert committed(root) == [5]  # checkpoint callbacks run after the others: the step the signal came in
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert not list(home.glob("hpc_ckpt_*.ckpt"))

    hpc_run = slurm_trainer(max_steps=2)
    hpc_run.fit(lightning_train.Regressor())
    hpc_run.save_checkpoint(home / "hpc_ckpt_1.ckpt")  # what Lightning's own handler would have left
    requeued = DistributedCheckpoint(root, every_n_train_steps=100)
    run = slurm_trainer(requeued, max_steps=8)
    run.fit(lightning_train.Regressor())
    assert requeued.resumed_from == 5 and run.global_step == 8


class _Numbers(torch.utils.data.IterableDataset):
    """A deterministic stream of 40 samples with no state: the same order on every pass."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        xs = torch.randn(40, 16, generator=g)
        for i in range(40):
            yield xs[i], xs[i].sum().reshape(1), i


class _OnStream(lightning_train.Regressor):
    def __init__(self):
        super().__init__()
        self.trained: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.trained.append(idx.tolist())
        return torch.nn.functional.mse_loss(self(x), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Numbers(), batch_size=4)


def test_iterable_without_position_warns_at_start_and_never_trains_a_batch_twice(tmp_path):
    """A plain DataLoader over an IterableDataset keeps no position: the first ``fit`` already says what a resume
    does; a resume mid-epoch reads and drops the batches already trained, so the run trains what the uninterrupted
    run trains (each sample once per epoch), in the same order."""
    straight = _OnStream()
    trainer(tmp_path / "a", max_steps=14, callbacks=[DistributedCheckpoint(tmp_path / "a" / "ck")]).fit(straight)

    first, second = _OnStream(), _OnStream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "b", max_steps=6,
                callbacks=[DistributedCheckpoint(tmp_path / "b" / "ck", every_n_train_steps=3)]).fit(first)
    assert any("keeps no position" in str(w.message) for w in caught)
    cb = DistributedCheckpoint(tmp_path / "b" / "ck", every_n_train_steps=3)
    trainer(tmp_path / "b", max_steps=14, callbacks=[cb]).fit(second)
    assert cb.resumed_from == 6
    assert first.trained + second.trained == straight.trained
    epoch0 = [i for batch in (first.trained + second.trained)[:10] for i in batch]
    assert epoch0 == list(range(40))


def test_model_checkpoint_alongside_keeps_its_ckpt_files_and_state(tmp_path):
    """``DistributedCheckpoint`` replaces the default ``ModelCheckpoint``; passed together, Lightning's ``.ckpt``
    files are still written and ``ModelCheckpoint``'s state is restored from our checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    root, mc_dir = tmp_path / "ck", tmp_path / "mc"

    def callbacks():
        return [DistributedCheckpoint(root, every_n_train_steps=4),
                ModelCheckpoint(dirpath=mc_dir, every_n_train_steps=4, save_last=True)]

    first = trainer(tmp_path, callbacks=callbacks())
    first.fit(lightning_train.Regressor())
    last_path = next(c for c in first.callbacks if isinstance(c, ModelCheckpoint)).last_model_path
    assert committed(root) == [4, 8] and (mc_dir / "last.ckpt").exists()

    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["last"] = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)).last_model_path

    second = trainer(tmp_path, max_steps=12, callbacks=[*callbacks(), Look()])
    second.fit(lightning_train.Regressor())
    ours = next(c for c in second.callbacks if isinstance(c, DistributedCheckpoint))
    assert ours.resumed_from == 8 and second.global_step == 12
    assert seen["last"] == last_path  # ModelCheckpoint's state came back with our checkpoint
    assert committed(root) == [4, 8, 12] and any("step=12" in p.name for p in mc_dir.iterdir())


def test_ckpt_path_last_means_our_newest_checkpoint_with_one_message(tmp_path, caplog):
    """``fit(ckpt_path="last")`` without a ``ModelCheckpoint``: no "no last checkpoint" warning, a resume from the
    newest valid checkpoint under ``dirpath``; ``validate(ckpt_path="last")`` evaluates its weights."""
    import logging

    root = tmp_path / "ck"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, callbacks=[DistributedCheckpoint(root, every_n_train_steps=4)]).fit(
            lightning_train.Regressor(), ckpt_path="last")  # the first run: nothing yet, quietly
    assert not [w for w in caught if "last" in str(w.message)]
    cb = DistributedCheckpoint(root, every_n_train_steps=4)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        warnings.simplefilter("always")
        trainer(tmp_path, max_steps=12, callbacks=[cb]).fit(lightning_train.Regressor(), ckpt_path="last")
    assert not [w for w in caught if "no last checkpoint" in str(w.message)]
    assert cb.resumed_from == 8 and f"fit(ckpt_path='last') uses the newest valid checkpoint under {root}" in caplog.text

    evaluated = _Evaluated()
    trainer(tmp_path, callbacks=[DistributedCheckpoint(root)], limit_val_batches=1).validate(evaluated, ckpt_path="last")
    reference = lightning_train.Regressor()
    from ckpt_core.loop import load_model_weights

    load_model_weights(reference, str(root), cb.settings)
    assert all(torch.equal(evaluated.seen[k], v) for k, v in reference.state_dict().items())


def test_export_lightning_ckpt_loads_with_load_from_checkpoint(tmp_path):
    """``ckpt export --format lightning`` (also chosen by a ``.ckpt`` name) writes what
    ``MyModule.load_from_checkpoint`` reads: the saved weights and the module's hyperparameters."""
    from ckpt_core.cli import main as ckpt

    root = tmp_path / "ck"
    model = lightning_train.Regressor(samples=48, batch_size=4, lr=0.02)
    trainer(tmp_path, max_steps=6, callbacks=[DistributedCheckpoint(root, every_n_train_steps=6)]).fit(model)
    out = tmp_path / "model.ckpt"
    assert ckpt(["export", str(root / "step_000000006"), str(out)]) == 0
    loaded = lightning_train.Regressor.load_from_checkpoint(out)
    assert (loaded.hparams.samples, loaded.hparams.batch_size, loaded.hparams.lr) == (48, 4, 0.02)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.load(out, weights_only=True)["global_step"] == 6
