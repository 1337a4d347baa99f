"""``ckpt_core.data.ResumableLoader``: what it counts, when it restores the RNG, what a lookahead checkpoint holds."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch.utils.data import DataLoader

from ckpt_core import rng
from ckpt_core.data import GLOBAL, NONE, STATEFUL, ResumableDistributedSampler, ResumableLoader
from ckpt_core import ResumableLoader as ReExported


def global_loader(n: int = 12, batch: int = 2, world: int = 2) -> DataLoader:
    sampler = ResumableDistributedSampler(list(range(n)), num_replicas=world, rank=0, shuffle=False)
    return DataLoader(list(range(n)), batch_size=batch, sampler=sampler)


class Ticker:
    """A loader without length that keeps its own position; each fetch draws from the global RNG (augmentation)."""

    def __init__(self, n: int = 10) -> None:
        self.n, self.pos = n, 0
        self.events: list[str] = []

    def __iter__(self):
        self.events.append("iter")  # creating the iterator (a DataLoader draws its base seed here)
        return self._batches()

    def _batches(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1, torch.rand(()).item()

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = state["pos"]


def test_the_core_name_is_the_same_class():
    assert ReExported is ResumableLoader


def test_each_batch_handed_out_counts_and_a_full_pass_moves_to_the_next_epoch():
    wrapper = ResumableLoader(global_loader())
    assert wrapper.mode == GLOBAL and wrapper.batch_size == 2
    for i, _ in enumerate(wrapper):
        if i == 1:
            break
    assert wrapper.state_dict()["consumed"] == 8  # 2 batches x 2 samples x 2 replicas
    assert [b.tolist() for b in wrapper] == [[8, 10]]  # a new pass continues where training was
    assert (wrapper.epoch, wrapper.sampler.consumed) == (1, 0)
    with pytest.raises(RuntimeError, match="marks_trained=True"):
        wrapper.mark_trained()


def test_marked_loader_counts_only_marked_batches_and_leaves_epochs_to_the_framework():
    wrapper = ResumableLoader(global_loader(), marks_trained=True)
    batches = list(wrapper)  # fetched, none trained
    assert len(batches) == 3 and wrapper.state_dict()["consumed"] == 0 and wrapper.epoch == 0
    wrapper.mark_trained()
    wrapper.mark_trained()
    assert wrapper.state_dict()["consumed"] == 8 and wrapper.sampler.epoch_start == 0


def test_rng_restore_runs_right_after_the_iterator_is_created():
    ticker = Ticker()
    wrapper = ResumableLoader(ticker)
    assert wrapper.mode == STATEFUL
    wrapper.defer(lambda: ticker.events.append("restore"))
    next(iter(wrapper))
    assert ticker.events == ["iter", "restore"]
    assert wrapper.state_dict() == {"pos": 1}  # the loader's own state, as saved by the core


def test_modes_and_their_checks():
    with pytest.raises(ValueError, match="StatefulDataLoader"):
        ResumableLoader([1, 2, 3])
    with pytest.raises(ValueError, match="needs a ResumableDistributedSampler"):
        ResumableLoader(Ticker(), GLOBAL)
    none = ResumableLoader([1, 2, 3], NONE, marks_trained=True)
    assert none.state_dict() == {} and list(none) == [1, 2, 3]
    none.load_state_dict({})


def run_ahead(wrapper: ResumableLoader, steps: int, save_at: Optional[int] = None):
    """A framework loop that fetches one batch ahead of training (as Lightning does for loaders without length).

    Returns the (batch, fetch draw, training draw) of each trained batch and, when ``save_at`` is given,
    the checkpoint (loader state, RNG state) taken after that many trained batches.
    """
    it = iter(wrapper)
    ahead = next(it, None)
    trained, saved = [], None
    while ahead is not None and len(trained) < steps:
        current, ahead = ahead, next(it, None)
        trained.append((*current, torch.rand(()).item()))
        wrapper.mark_trained()
        if len(trained) == save_at:
            saved = wrapper.state_dict(), rng.capture()
    return trained, saved


@pytest.mark.parametrize("save_at", [1, 3, 9, 10])
def test_lookahead_checkpoint_resumes_the_same_batches_and_draws(save_at):
    torch.manual_seed(0)
    reference, _ = run_ahead(ResumableLoader(Ticker(), STATEFUL, marks_trained=True), 10)
    torch.manual_seed(0)
    _, (state, rng_state) = run_ahead(ResumableLoader(Ticker(), STATEFUL, marks_trained=True), save_at, save_at)
    assert state["loader"] == {"pos": save_at}  # not the batch fetched ahead

    torch.manual_seed(123)  # a fresh process
    resumed = ResumableLoader(Ticker(), STATEFUL, marks_trained=True)
    resumed.load_state_dict(state)
    resumed.defer(lambda: rng.apply(rng_state))
    rest, _ = run_ahead(resumed, 10)
    assert rest == reference[save_at:]


def test_sized_marked_stateful_loader_saves_its_current_state():
    class SizedTicker(Ticker):
        def __len__(self) -> int:
            return self.n

    wrapper = ResumableLoader(SizedTicker(4), STATEFUL, marks_trained=True)
    next(iter(wrapper))
    assert wrapper.state_dict() == {"loader": {"pos": 1}, "rng_before_next": None}
