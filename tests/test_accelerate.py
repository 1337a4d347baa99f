"""accelerate_ckpt in one process: the gaps of Accelerate's save_state/load_state, and the plugin closing them.

Each "run" builds a fresh Accelerator (state singletons reset), a model with
dropout, AdamW, a StepLR scheduler and a DataLoader over a dataset that
returns its index. A stock-Accelerate run demonstrates each gap where that is
cheap; the same interruption through the plugin resumes bit-exactly.
The plugin runs here use ``async_mode="thread"`` (no background process);
the multi-process tests run the default process mode.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

import accelerate  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402

from accelerate_ckpt import Accelerator, CheckpointPlugin  # noqa: E402
from ckpt_core import Preempted, ResumableDistributedSampler  # noqa: E402
from ckpt_core.data import find_resumable_sampler  # noqa: E402

N = 48  # samples; batch 4 -> 12 steps per epoch
BS = 4


class IndexedData(Dataset):
    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Counter:
    """An object registered with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


class ListTracker(GeneralTracker):
    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict, int]] = []

    @property
    def tracker(self):
        return self.logged

    def log(self, values: dict, step=None, **kwargs) -> None:
        self.logged.append((dict(values), step))


def fresh(plugin=None, *, shuffle=True, attach_late=False, **acc_kwargs):
    """A new Accelerator + prepared (model, optimizer, dataloader, scheduler)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if plugin is not None and not attach_late:
        acc = Accelerator(cpu=True, checkpoint_plugin=plugin, **acc_kwargs)
    else:
        acc = accelerate.Accelerator(cpu=True, **acc_kwargs)
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    dl = DataLoader(IndexedData(), batch_size=BS, shuffle=shuffle)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    if plugin is not None and attach_late:
        plugin.attach(acc)
    return acc, model, opt, dl, sched


def train(acc, model, opt, sched, batches, n_steps, plugin=None, registered=None):
    """Train ``n_steps`` batches from the iterable ``batches``; returns [(loss, indices)]."""
    out = []
    model.train()
    loss_fn = nn.MSELoss()
    while len(out) < n_steps:
        for x, y, idx in batches() if callable(batches) else batches:
            loss = loss_fn(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            if registered is not None:
                registered.n += 1
            if plugin is not None:
                plugin.step(loss=loss)
            out.append((loss.item(), idx.tolist()))
            if len(out) >= n_steps:
                break
    return out


def plugin_for(root, **kw) -> CheckpointPlugin:
    kw.setdefault("async_mode", "thread")
    kw.setdefault("handle_preemption", False)
    return CheckpointPlugin(dirpath=None if root is None else str(root), env={}, argv=[], **kw)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def plugin_run(root, n_steps, *, shuffle=True, every=None, **kw):
    """Fresh plugin run: resume if possible, train ``n_steps`` more; returns (records, weights, plugin)."""
    plugin = plugin_for(root, every_n_steps=every, **kw)
    acc, model, opt, dl, sched = fresh(plugin, shuffle=shuffle)
    plugin.resume()
    recs = train(acc, model, opt, sched, lambda: plugin.dataloader(dl), n_steps, plugin)
    plugin.close()
    return recs, weights(model), plugin


@pytest.fixture(autouse=True)
def _reset_accelerate():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# ---------------------------------------------------------------- data loader rebuild
def test_prepare_rebuilds_shuffled_loader_on_resumable_sampler(tmp_path):
    plugin = plugin_for(tmp_path)
    acc, model, opt, dl, sched = fresh(plugin)
    sampler = find_resumable_sampler(dl)
    assert isinstance(sampler, ResumableDistributedSampler) and sampler.shuffle
    assert type(dl).__name__ == "DataLoaderShard" and dl in acc._dataloaders
    assert dl.total_batch_size == BS and len(dl) == N // BS
    # the global order is DistributedSampler's order for the agreed seed
    order = [i for _, _, idx in dl for i in idx.tolist()]
    expected = torch.randperm(N, generator=torch.Generator().manual_seed(sampler.seed + 0)).tolist()
    assert order == expected
    # an unshuffled (evaluation) loader is left to Accelerate
    eval_dl = acc.prepare(DataLoader(IndexedData(), batch_size=BS))
    assert find_resumable_sampler(eval_dl) is None
    plugin.close()


# ----------------------------------------------------------------------- the gaps
def test_gap_rng_restored_before_iterator_draws(tmp_path):
    """Stock: load_state restores the RNG, then the new iterator draws from it: dropout masks shift.

    An unshuffled loader isolates this from the data order: the stock resumed
    run sees the right samples but different losses; the plugin's run does not.
    """
    acc, model, opt, dl, sched = fresh(shuffle=False)
    ref = train(acc, model, opt, sched, dl, 8)
    acc, model, opt, dl, sched = fresh(shuffle=False)
    train(acc, model, opt, sched, dl, 4)
    acc.save_state(str(tmp_path / "stock"))
    acc, model, opt, dl, sched = fresh(shuffle=False)
    acc.load_state(str(tmp_path / "stock"))
    resumed = train(acc, model, opt, sched, acc.skip_first_batches(dl, 4), 4)
    assert [r[1] for r in resumed] == [r[1] for r in ref[4:]]  # same samples...
    assert [r[0] for r in resumed] != [r[0] for r in ref[4:]]  # ...different dropout: the gap

    ref_p, w_ref, _ = plugin_run(tmp_path / "p_ref", 8, shuffle=False)
    plugin_run(tmp_path / "p", 4, shuffle=False, every=4)
    resumed_p, w, plugin = plugin_run(tmp_path / "p", 4, shuffle=False)
    assert plugin.resumed_from == 4
    assert resumed_p == ref_p[4:]
    assert all(torch.equal(w[k], w_ref[k]) for k in w)


def test_gap_skip_first_batches_skips_another_permutation(tmp_path):
    """Stock: skip_first_batches on a plain shuffled loader skips over a different permutation."""
    acc, model, opt, dl, sched = fresh()
    ref = train(acc, model, opt, sched, dl, 8)
    acc, model, opt, dl, sched = fresh()
    train(acc, model, opt, sched, dl, 4)
    acc.save_state(str(tmp_path / "stock"))
    acc, model, opt, dl, sched = fresh()
    acc.load_state(str(tmp_path / "stock"))
    resumed = train(acc, model, opt, sched, acc.skip_first_batches(dl, 4), 4)
    seen_ref = {i for r in ref[:4] for i in r[1]}
    seen_after = [i for r in resumed for i in r[1]]
    assert [r[1] for r in resumed] != [r[1] for r in ref[4:]]  # the gap: other samples
    assert seen_ref & set(seen_after)  # some samples of the epoch are seen twice (and others never)

    ref_p, w_ref, _ = plugin_run(tmp_path / "p_ref", 8)
    plugin_run(tmp_path / "p", 4, every=4)
    resumed_p, w, _ = plugin_run(tmp_path / "p", 4)
    assert resumed_p == ref_p[4:]
    assert all(torch.equal(w[k], w_ref[k]) for k in w)


def test_gap_epoch_not_saved(tmp_path):
    """Stock: DataLoaderShard.iteration (the epoch) is not saved; the plugin restores it."""
    steps_per_epoch = N // BS
    acc, model, opt, dl, sched = fresh()
    train(acc, model, opt, sched, dl, steps_per_epoch + 3)
    assert dl.iteration == 1
    acc.save_state(str(tmp_path / "stock"))
    acc, model, opt, dl, sched = fresh()
    acc.load_state(str(tmp_path / "stock"))
    assert dl.iteration == 0  # the gap: a resumed run replays epoch 0's order

    ref_p, w_ref, _ = plugin_run(tmp_path / "p_ref", steps_per_epoch + 8)
    plugin_run(tmp_path / "p", steps_per_epoch + 3, every=steps_per_epoch + 3)
    plugin = plugin_for(tmp_path / "p")
    acc, model, opt, dl, sched = fresh(plugin)
    plugin.resume()
    assert dl.iteration == 1 and plugin.epoch == 1 and find_resumable_sampler(dl).consumed == 3 * BS
    resumed = train(acc, model, opt, sched, lambda: plugin.dataloader(dl), 5, plugin)
    plugin.close()
    assert resumed == ref_p[steps_per_epoch + 3:]
    assert all(torch.equal(v, w_ref[k]) for k, v in weights(model).items())


def test_resume_from_the_last_batch_of_an_epoch(tmp_path):
    """A checkpoint taken right after an epoch's last batch resumes at the next epoch's first batch."""
    spe = N // BS
    ref, w_ref, _ = plugin_run(tmp_path / "ref", 2 * spe + 2)
    plugin_run(tmp_path / "p", spe, every=spe)
    resumed, w, plugin = plugin_run(tmp_path / "p", spe + 2)
    assert plugin.resumed_from == spe
    assert resumed == ref[spe:]
    assert all(torch.equal(w[k], w_ref[k]) for k in w)


def _project(tmp_path: Path) -> ProjectConfiguration:
    return ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)


def test_gap_iteration_not_restored_rotation_loads_stale_checkpoint(tmp_path):
    """Stock: load_state does not restore ProjectConfiguration.iteration; the next save reuses a number,
    rotation deletes the wrong checkpoint, and the next load_state picks a stale one."""
    acc, model, opt, dl, sched = fresh(project_config=_project(tmp_path / "stock"))
    train(acc, model, opt, sched, dl, 2)
    acc.save_state()
    train(acc, model, opt, sched, dl, 2)
    acc.save_state()
    acc, model, opt, dl, sched = fresh(project_config=_project(tmp_path / "stock"))
    acc.load_state()
    assert acc.save_iteration == 0  # the gap
    train(acc, model, opt, sched, dl, 2)
    newest = weights(model)
    acc.save_state()  # deletes checkpoint_0, writes the newest state as checkpoint_0
    acc, model, opt, dl, sched = fresh(project_config=_project(tmp_path / "stock"))
    acc.load_state()  # picks checkpoint_1: older than what was saved last
    assert not all(torch.equal(v, newest[k]) for k, v in weights(model).items())


def test_save_state_load_state_go_through_the_core_and_always_load_the_newest(tmp_path):
    """save, resume, save again, resume again (save_state/load_state, rotation): always the newest."""
    def run(n_steps, load):
        plugin = plugin_for(None)  # dirpath and keep_last come from the ProjectConfiguration
        registered = Counter()
        acc, model, opt, dl, sched = fresh(plugin, project_config=_project(tmp_path / "p"))
        acc.register_for_checkpointing(registered)
        if load:
            acc.load_state()
        n0 = registered.n
        train(acc, model, opt, sched, lambda: plugin.dataloader(dl), n_steps, registered=registered)
        acc.save_state()
        plugin.wait()
        return acc, plugin, weights(model), registered, n0

    acc, plugin, _, _, _ = run(2, load=False)
    assert plugin.settings.dirpath == str(tmp_path / "p" / "checkpoints") and plugin.settings.keep_last == 2
    acc, plugin, _, _, _ = run(2, load=True)
    assert acc.save_iteration == 2
    acc, plugin, newest, reg, n0 = run(2, load=True)
    assert n0 == 4 and reg.n == 6 and acc.save_iteration == 3
    steps = [r.step for r in plugin.manager.list()]
    assert steps == [1, 2]  # saves numbered 0, 1, 2 (no step counter in this script); the newest two kept
    plugin.close()
    AcceleratorState._reset_state(True)
    plugin = plugin_for(None)
    acc, model, opt, dl, sched = fresh(plugin, project_config=_project(tmp_path / "p"))
    acc.register_for_checkpointing(reg2 := Counter())
    acc.load_state()
    assert plugin.resumed_from == 2 and reg2.n == 6 and acc.save_iteration == 3
    assert all(torch.equal(v, newest[k]) for k, v in weights(model).items())
    # stock's names (the plugins of the first runs were never closed: whether their lease file is still there
    # depends on when the garbage collector frees them, e.g. in a distributed manager's close())
    names = sorted(os.listdir(tmp_path / "p" / "checkpoints"))
    assert [n for n in names if not n.startswith(".ckpt-lease.")] == ["checkpoint_1", "checkpoint_2"], names
    # load_state of one checkpoint directory loads exactly that checkpoint
    acc.load_state(str(tmp_path / "p" / "checkpoints" / "checkpoint_1"))
    assert plugin.resumed_from == 1 and reg2.n == 4
    plugin.close()


def test_stock_style_script_with_plugin_attached_resumes_exactly(tmp_path):
    """A script written for stock Accelerate (save_state, load_state, skip_first_batches) with the plugin
    attached: its own skip now lands on the same permutation, and the dropout stream is the saved one."""
    acc, model, opt, dl, sched = fresh(plugin_for(tmp_path / "ref"))
    ref = train(acc, model, opt, sched, dl, N // BS + 6)
    acc.checkpoint_plugin.close()
    w_ref = weights(model)

    plugin = plugin_for(tmp_path / "p")
    acc, model, opt, dl, sched = fresh(plugin)
    train(acc, model, opt, sched, dl, N // BS + 3)  # into epoch 1
    assert acc.save_state() == os.path.join(str(tmp_path / "p"), "step_000000000")
    plugin.close()
    plugin = plugin_for(tmp_path / "p")
    acc, model, opt, dl, sched = fresh(plugin)
    acc.load_state()
    assert dl.iteration == 1
    resumed = train(acc, model, opt, sched, acc.skip_first_batches(dl, 3), 3)
    plugin.close()
    assert resumed == ref[N // BS + 3:]
    assert all(torch.equal(v, w_ref[k]) for k, v in weights(model).items())


def test_plugin_steps_save_state_rotation_newest(tmp_path):
    """The training-loop path: resume, save, resume again with keep_last: the newest is always loaded."""
    ref, _, _ = plugin_run(tmp_path / "ref", 9)
    a, _, p1 = plugin_run(tmp_path / "p", 3, every=1, keep_last=2)
    b, _, p2 = plugin_run(tmp_path / "p", 3, every=1, keep_last=2)
    c, _, p3 = plugin_run(tmp_path / "p", 3, every=1, keep_last=2)
    assert (p2.resumed_from, p3.resumed_from) == (3, 6)
    assert a + b + c == ref
    assert [r.step for r in p3.manager.list()] == [6, 8, 9]  # the newest two, and the one resumed from


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    ref, w_ref, _ = plugin_run(tmp_path / "ref", 10)
    plugin_run(tmp_path / "p", 8, every=4)
    newest = tmp_path / "p" / "step_000000008"
    shard = next(f for f in newest.iterdir() if f.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-7])  # torn shard
    with pytest.warns(UserWarning, match="step_000000008.*falling back"):
        resumed, w, plugin = plugin_run(tmp_path / "p", 6)
    assert plugin.resumed_from == 4
    assert resumed == ref[4:]
    assert all(torch.equal(w[k], w_ref[k]) for k in w)


# ------------------------------------------------------------- state and plumbing
def test_registered_objects_scaler_and_counters_are_restored(tmp_path):
    plugin = plugin_for(tmp_path)
    acc, model, opt, dl, sched = fresh(plugin)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    acc.register_for_checkpointing(reg := Counter())
    train(acc, model, opt, sched, lambda: plugin.dataloader(dl), 5, plugin, registered=reg)
    acc.step = 3
    saved_lr = sched.get_last_lr()
    assert plugin.save() == os.path.join(str(tmp_path), "step_000000005")
    plugin.close()

    plugin = plugin_for(tmp_path)
    acc, model, opt, dl, sched = fresh(plugin)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    acc.register_for_checkpointing(reg := Counter())
    info = plugin.resume()
    assert info.step == 5 and plugin.global_step == 5
    assert reg.n == 5 and acc.step == 3 and acc.scaler.get_scale() == 256.0
    assert sched.get_last_lr() == saved_lr and acc.save_iteration == 1
    assert find_resumable_sampler(dl).consumed == 5 * BS
    plugin.close()


def test_gradient_accumulation_counts_optimizer_steps_and_never_saves_mid_window(tmp_path):
    plugin = plugin_for(tmp_path, every_n_steps=1)
    acc, model, opt, dl, sched = fresh(plugin, gradient_accumulation_steps=2)
    saved = []
    for i, (x, y, _) in enumerate(plugin.dataloader(dl)):
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        saved.append(plugin.step())
        if i == 5:
            break
    plugin.close()
    assert plugin.global_step == 3 and saved == [False, True] * 3
    assert [r.step for r in plugin.manager.list()] == [1, 2, 3]


def test_preemption_signal_saves_at_the_next_step_and_exits(tmp_path):
    plugin = plugin_for(tmp_path, handle_preemption=True)
    acc, model, opt, dl, sched = fresh(plugin)
    train(acc, model, opt, sched, lambda: plugin.dataloader(dl), 2, plugin)
    os.kill(os.getpid(), signal.SIGTERM)  # recorded by the core's handler; acted on at the step boundary
    with pytest.raises(Preempted) as exc:
        train(acc, model, opt, sched, lambda: plugin.dataloader(dl), 1, plugin)
    assert exc.value.code == 143 and exc.value.step == 3
    plugin.close()
    assert [(r.step, r.committed) for r in plugin.manager.list()] == [(3, True)]


def test_metrics_go_to_accelerator_log(tmp_path):
    tracker = ListTracker()
    plugin = plugin_for(tmp_path, every_n_steps=2)
    acc, model, opt, dl, sched = fresh(plugin, log_with=[tracker])
    acc.init_trackers("run")
    train(acc, model, opt, sched, lambda: plugin.dataloader(dl), 4, plugin)
    plugin.close()
    ckpt = [(v, s) for v, s in tracker.logged if "ckpt/step" in v]
    assert [v["ckpt/step"] for v, _ in ckpt] == [2.0, 4.0]
    assert all("ckpt/blocking_s" in v and "ckpt/write_s" in v for v, _ in ckpt)


def test_the_checkpoint_age_is_logged_every_log_every_n_steps(tmp_path):
    """``ckpt/age_s`` reaches the trackers between saves too (here every 2 steps, saves every 5), at the plugin's step."""
    tracker = ListTracker()
    plugin = plugin_for(tmp_path, every_n_steps=5, log_every_n_steps=2, async_mode="off")
    acc, model, opt, dl, sched = fresh(plugin, log_with=[tracker])
    acc.init_trackers("run")
    train(acc, model, opt, sched, lambda: plugin.dataloader(dl), 6, plugin)
    plugin.close()
    alerts = [(v, s) for v, s in tracker.logged if "ckpt/age_s" in v and "ckpt/step" not in v]
    assert [s for _, s in alerts] == [2, 4, 6]
    assert alerts[2][0]["ckpt/age_s"] < alerts[1][0]["ckpt/age_s"]  # step 5's checkpoint committed in between
    assert all(v["ckpt/failed_saves"] == 0.0 and v["ckpt/fallbacks"] == 0.0 for v, _ in alerts)
    with pytest.raises(ValueError, match="log_every_n_steps must be a non-negative int"):
        plugin_for(tmp_path, log_every_n_steps=-1)


def test_attach_to_an_accelerator_built_elsewhere_after_prepare(tmp_path):
    """HF Trainer/TRL style: the Accelerator exists and prepared the loader before the plugin is attached."""
    def run(n):
        plugin = plugin_for(tmp_path / "p", every_n_steps=3)
        acc, model, opt, dl, sched = fresh(plugin, attach_late=True)
        assert find_resumable_sampler(dl) is None  # prepared by stock Accelerate
        plugin.resume()  # finds the shuffled training loader and rebuilds it
        recs = train(acc, model, opt, sched, lambda: plugin.dataloader(dl), n, plugin)
        plugin.close()
        return recs, plugin

    ref, _ = run(6)
    import shutil

    shutil.rmtree(tmp_path / "p")
    a, _ = run(3)
    b, plugin = run(3)
    assert plugin.resumed_from == 3 and a + b == ref


def test_settings_from_environment_and_flags(tmp_path):
    plugin = CheckpointPlugin(dirpath=str(tmp_path), every_n_steps=100, keep_last=5,
                              env={"CKPT_EVERY_N_STEPS": "7"}, argv=["--ckpt.keep_last=2", "--lr", "1"])
    assert plugin.settings.every_n_steps == 7 and plugin.settings.keep_last == 2
    assert plugin.sources["every_n_steps"] == "env CKPT_EVERY_N_STEPS"
    assert plugin.sources["keep_last"] == "flag --ckpt.keep_last"
    with pytest.raises(ValueError, match="CKPT_EVRY_N_STEPS"):
        CheckpointPlugin(dirpath=str(tmp_path), env={"CKPT_EVRY_N_STEPS": "7"}, argv=[])


def test_plugin_requires_attach_and_one_training_loader(tmp_path):
    plugin = plugin_for(tmp_path)
    with pytest.raises(RuntimeError, match="not attached"):
        plugin.resume()
    acc, model, opt, dl, sched = fresh(plugin)
    other = acc.prepare(DataLoader(IndexedData(), batch_size=2, shuffle=True))
    with pytest.raises(ValueError, match="candidate training data loaders"):
        plugin.resume()
    plugin.dataloader(dl)
    with pytest.raises(ValueError, match="one training data loader"):
        plugin.dataloader(other)
    with pytest.raises(TypeError):
        Accelerator(cpu=True, checkpoint_plugin=object())
    plugin.close()
