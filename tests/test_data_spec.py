"""The rebuild rules (``ckpt_core.data.spec``, ``ckpt_core.data.stock``): on plain facts, then on real loaders."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ckpt_core.data import LoaderSpec, NotRebuildable, Sharding
from ckpt_core.data import stock
from ckpt_core.data.spec import LoaderFacts, loader_kwargs, refusal, sampler_seed, shuffles

PLAIN = LoaderFacts(iterable=False, length=10, batch_sampler="BatchSampler", stock_batch_sampler=True, batch_size=2,
                    sampler="RandomSampler", kind=stock.RANDOM, num_samples=10)


def facts(**changes) -> LoaderFacts:
    return dataclasses.replace(PLAIN, **changes)


# ------------------------------------------------------------------ pure rules
@pytest.mark.parametrize("changes,reason", [
    ({}, None),
    ({"kind": stock.SEQUENTIAL, "num_samples": None}, None),
    ({"kind": stock.DISTRIBUTED, "num_samples": None}, None),
    ({"iterable": True, "length": None}, "IterableDataset"),
    ({"length": None}, "no len"),
    ({"stock_batch_sampler": False, "batch_sampler": "Bucketing"}, "batch sampler is a custom Bucketing"),
    ({"batch_size": None}, "batch_sampler="),
    ({"replacement": True}, "replacement"),
    ({"num_samples": 7}, "custom number of samples"),
    ({"kind": stock.CUSTOM, "sampler": "Curriculum"}, "sampler is a custom Curriculum"),
])
def test_refusal(changes, reason):
    got = refusal(facts(**changes))
    assert got is None if reason is None else reason in got


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.one_of(st.none(), st.integers(0, 5)), st.booleans(), st.one_of(st.none(), st.integers(0, 4)),
       st.sampled_from([stock.RANDOM, stock.SEQUENTIAL, stock.DISTRIBUTED, stock.CUSTOM]), st.booleans(),
       st.one_of(st.none(), st.integers(0, 6)))
def test_refusal_accepts_exactly_the_loaders_that_visit_each_sample_once(iterable, length, stock_bs, batch_size,
                                                                         kind, replacement, num_samples):
    f = facts(iterable=iterable, length=length, stock_batch_sampler=stock_bs, batch_size=batch_size, kind=kind,
              replacement=replacement, num_samples=num_samples)
    once = kind != stock.CUSTOM and (kind != stock.RANDOM or (not replacement and num_samples == length))
    sized = not iterable and length is not None
    assert (refusal(f) is None) == (sized and stock_bs and batch_size is not None and once)


def test_shuffles_follows_the_replaced_sampler():
    assert shuffles(facts()) is True
    assert shuffles(facts(kind=stock.SEQUENTIAL)) is False
    assert shuffles(facts(kind=stock.DISTRIBUTED, sampler_shuffle=True)) is True
    assert shuffles(facts(kind=stock.DISTRIBUTED, sampler_shuffle=False)) is False


# ------------------------------------------------------------------ stock classes
class MyRandom(RandomSampler):
    """A subclass may change the order: not stock."""


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_sampler_kinds_match_classes_exactly():
    data = list(range(6))
    assert stock.sampler_kind(RandomSampler(data)) == stock.RANDOM
    assert stock.sampler_kind(SequentialSampler(data)) == stock.SEQUENTIAL
    assert stock.sampler_kind(DistributedSampler(data, num_replicas=2, rank=0)) == stock.DISTRIBUTED
    assert stock.sampler_kind(MyRandom(data)) == stock.CUSTOM
    assert stock.is_stock_batch_sampler(BatchSampler(SequentialSampler(data), 2, False))
    assert not stock.is_stock_batch_sampler(type("MyBatches", (BatchSampler,), {})(SequentialSampler(data), 2, False))


def test_torchdata_samplers_are_stock():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    loader = sdl.StatefulDataLoader(list(range(6)), batch_size=2, shuffle=True)
    assert stock.sampler_kind(loader.sampler) == stock.RANDOM and stock.is_stock_batch_sampler(loader.batch_sampler)
    spec = LoaderSpec.from_dataloader(loader)
    assert isinstance(spec, LoaderSpec) and spec.shuffle and spec.seed == loader.sampler.generator.initial_seed()


# ------------------------------------------------------------------ real loaders
def test_spec_of_a_shuffled_loader_keeps_its_arguments():
    data = list(range(10))
    collate = lambda batch: batch  # noqa: E731
    spec = LoaderSpec.from_dataloader(DataLoader(data, batch_size=3, shuffle=True, drop_last=True, collate_fn=collate))
    assert isinstance(spec, LoaderSpec)
    assert (spec.dataset, spec.batch_size, spec.drop_last, spec.shuffle, spec.seed, spec.sharding) == (
        data, 3, True, True, None, None)
    assert spec.kwargs["collate_fn"] is collate and spec.kwargs["num_workers"] == 0
    assert not {"dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(spec.kwargs)


def test_seed_comes_from_the_samplers_own_generator_or_distributed_seed():
    data = list(range(10))
    gen = torch.Generator().manual_seed(77)
    assert LoaderSpec.from_dataloader(DataLoader(data, batch_size=2, shuffle=True, generator=gen)).seed == 77
    assert sampler_seed(RandomSampler(data, generator=gen), use_generator=False) is None
    sharded = LoaderSpec.from_dataloader(
        DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=3, rank=2, shuffle=False,
                                                                  seed=5, drop_last=True)))
    assert (sharded.shuffle, sharded.seed, sharded.sharding) == (False, 5, Sharding(3, 2, True))


@pytest.mark.parametrize("make,reason", [
    (lambda d: DataLoader(Stream(), batch_size=2), "IterableDataset"),
    (lambda d: DataLoader(d, batch_size=2, sampler=RandomSampler(d, replacement=True)), "replacement"),
    (lambda d: DataLoader(d, batch_size=2, sampler=RandomSampler(d, num_samples=4)), "custom number"),
    (lambda d: DataLoader(d, batch_size=2, sampler=MyRandom(d)), "custom MyRandom"),
    (lambda d: DataLoader(d, batch_sampler=BatchSampler(SequentialSampler(d), 2, False)), "batch_sampler="),
])
def test_loaders_that_cannot_be_rebuilt_say_why(make, reason):
    got = LoaderSpec.from_dataloader(make(list(range(10))))
    assert isinstance(got, NotRebuildable) and reason in got.reason


def test_explicit_num_samples_of_one_pass_is_rebuildable():
    data = list(range(10))
    spec = LoaderSpec.from_dataloader(DataLoader(data, batch_size=2, sampler=RandomSampler(data, num_samples=10)))
    assert isinstance(spec, LoaderSpec) and spec.shuffle


def test_kwargs_are_the_ones_accelerate_rebuilds_with():
    data_loader = pytest.importorskip("accelerate.data_loader")
    loader = DataLoader(list(range(10)), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)
    ignore = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
    expected = {k: getattr(loader, k, d) for k, d in data_loader._PYTORCH_DATALOADER_KWARGS.items() if k not in ignore}
    assert loader_kwargs(loader) == expected


def test_accelerates_seedable_sampler_is_stock_once_loaded():
    data_loader = pytest.importorskip("accelerate.data_loader")
    sampler = data_loader.SeedableRandomSampler(data_source=list(range(10)), data_seed=9)
    assert stock.sampler_kind(sampler) == stock.RANDOM
    assert sampler_seed(sampler, use_generator=False) == 9
