"""Properties of the pure global-order math (``ckpt_core.data.order``) and the sampler built on it."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from ckpt_core.data import ResumableDistributedSampler
from ckpt_core.data.order import epoch_permutation, rank_indices, rank_share

FAST = settings(max_examples=200, deadline=None)


@st.composite
def epochs(draw):
    """(order, consumed, world): an epoch's order, a position in it, and a world size."""
    n = draw(st.integers(min_value=0, max_value=60))
    order = epoch_permutation(n, draw(st.integers(0, 5)), draw(st.integers(0, 2**31)), draw(st.booleans()))
    return order, draw(st.integers(min_value=0, max_value=n)), draw(st.integers(min_value=1, max_value=8))


@FAST
@given(st.integers(0, 80), st.integers(0, 9), st.integers(0, 2**31), st.booleans())
def test_epoch_permutation_is_a_deterministic_permutation(n, epoch, seed, shuffle):
    order = epoch_permutation(n, epoch, seed, shuffle)
    assert sorted(order) == list(range(n))
    assert order == epoch_permutation(n, epoch, seed, shuffle)
    if not shuffle:
        assert order == list(range(n))


@FAST
@given(epochs(), st.booleans())
def test_every_rank_reads_rank_share_indices(epoch, drop_last):
    order, consumed, world = epoch
    shares = [rank_indices(order, consumed, world, r, drop_last) for r in range(world)]
    assert {len(s) for s in shares} == {rank_share(len(order), consumed, world, drop_last)}


@FAST
@given(epochs())
def test_the_rest_of_the_epoch_is_read_once_padding_only_repeats(epoch):
    order, consumed, world = epoch
    rest = order[consumed:]
    read = Counter(i for r in range(world) for i in rank_indices(order, consumed, world, r, False))
    assert set(rest) <= set(read)
    assert sum(read.values()) - len(rest) < world  # padding fills the last round only
    dropped = [i for r in range(world) for i in rank_indices(order, consumed, world, r, True)]
    assert len(dropped) == len(set(dropped)) and set(dropped) <= set(rest)
    assert len(rest) - len(dropped) < world


@FAST
@given(epochs(), st.integers(0, 6), st.booleans())
def test_resuming_at_a_whole_round_continues_each_ranks_order(epoch, rounds, drop_last):
    order, _, world = epoch
    consumed = min(rounds * world, len(order) // world * world)
    for rank in range(world):
        full = rank_indices(order, 0, world, rank, drop_last)
        assert rank_indices(order, consumed, world, rank, drop_last) == full[consumed // world:]


@FAST
@given(st.integers(1, 50), st.integers(1, 6), st.integers(0, 2**31), st.booleans(), st.booleans())
def test_sampler_is_distributed_samplers_order_and_length(n, world, seed, shuffle, drop_last):
    data = range(n)
    for rank in range(world):
        ref = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
        ours = ResumableDistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                           drop_last=drop_last)
        assert list(ours) == list(ref) and len(ours) == len(ref)


def test_sampler_position_moves_only_by_advance_and_resets_with_a_new_epoch():
    s = ResumableDistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
    first = list(s)
    assert s.consumed == 0 and first == [0, 2, 4, 6, 8]
    s.advance(4)
    s.advance(100)
    assert s.consumed == 10 and list(s) == [] and len(s) == 0
    s.set_epoch(0)  # the epoch being resumed keeps its place
    assert s.consumed == 10
    s.set_epoch(1)
    assert (s.epoch, s.consumed, s.epoch_start) == (1, 0, 0)


def test_restored_position_is_where_the_epochs_counting_begins():
    s = ResumableDistributedSampler(range(20), num_replicas=2, rank=1, seed=3)
    s.set_epoch(2)
    s.advance(8)
    t = ResumableDistributedSampler(range(20), num_replicas=4, rank=0)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.consumed, t.epoch_start, t.seed) == (2, 8, 8, 3)
    t.advance(4)
    assert (t.consumed, t.epoch_start) == (12, 8)
