"""Specification of the named random streams."""

import pytest
import torch

from gcbs_lib.seeding import fixed_subset, generator, one_per_group, stream_seed


def test_a_stream_seed_is_reproducible():
    assert stream_seed(3, 1, "shuffle") == stream_seed(3, 1, "shuffle")


def test_stream_seeds_are_the_same_in_every_process_and_on_every_machine():
    # golden values: a per-process hash (Python's hash() of a str) would differ from run to run
    assert stream_seed(0, 0, "shuffle") == 2970866602957314496
    assert stream_seed(3, 2, "gcbs-relabel") == 1293804805679623354
    assert stream_seed(1, 0, "init") == 4432847060821249777
    shuffle = generator(3, 2, "gcbs-batch-shuffle")
    assert torch.randperm(8, generator=shuffle).tolist() == [0, 3, 2, 7, 6, 4, 1, 5]
    assert fixed_subset(20, 5, "test") == [4, 6, 8, 12, 14]


def test_seed_plus_epoch_does_not_collide_across_seeds():
    assert stream_seed(0, 1, "shuffle") != stream_seed(1, 0, "shuffle")


def test_purposes_of_one_seed_and_epoch_are_different_streams():
    seeds = {stream_seed(0, 0, p) for p in ("init", "shuffle", "gcbs-relabel", "dropout", "mining")}
    assert len(seeds) == 5


def test_generators_of_different_streams_draw_differently():
    a = torch.randperm(100, generator=generator(0, 1, "shuffle"))
    b = torch.randperm(100, generator=generator(1, 0, "shuffle"))
    assert not torch.equal(a, b)


def test_a_stream_needs_a_purpose():
    with pytest.raises(ValueError, match="purpose"):
        stream_seed(0, 0, "")


def test_a_fixed_subset_is_the_same_for_every_call_and_sorted():
    assert fixed_subset(100, 10, "train-subset") == fixed_subset(100, 10, "train-subset")
    assert fixed_subset(100, 10, "train-subset") == sorted(
        set(fixed_subset(100, 10, "train-subset"))
    )
    assert len(fixed_subset(100, 10, "train-subset")) == 10


def test_no_limit_or_a_limit_beyond_the_size_keeps_everything():
    assert fixed_subset(5, None, "x") == fixed_subset(5, 9, "x") == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("limit", [0, -5])
def test_a_limit_below_one_is_refused_naming_the_subset(limit):
    with pytest.raises(ValueError, match=f"the train-subset limit must be at least 1, got {limit}"):
        fixed_subset(100, limit, "train-subset")


def test_one_per_group_draws_each_group_once_uniformly_and_reproducibly():
    groups = torch.tensor([2, 0, 2, 1, 2, 0])  # group 2 holds items 0, 2 and 4
    draws = [one_per_group(groups, generator(0, epoch, "one-per-group")) for epoch in range(3000)]
    assert all(groups[d].sort().values.tolist() == [0, 1, 2] for d in draws)
    assert all(d.tolist() == sorted(d.tolist()) for d in draws)
    picked = torch.stack(draws).flatten().bincount(minlength=6) / len(draws)
    assert picked[3] == 1 and picked[[1, 5]].sum() == 1
    assert torch.allclose(picked[[0, 2, 4]], torch.tensor(1 / 3), atol=0.03)
    assert torch.equal(draws[7], one_per_group(groups, generator(0, 7, "one-per-group")))
